"""Merged export (issue 33): one tiny recipe run with `export.merged: true` (float32), then `hf-stable export` in
bfloat16 from the same run dir; the merged checkpoint loaded by transformers alone reproduces the reference the run
recorded, and a corrupted export (a tampered weight, a wrong stop token, another base) fails with a clear message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_recipe import run_recipe, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def _module(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 5-step run of the default recipe on the tiny Llama that exports (float32) at the end of training."""
    tmp = tmp_path_factory.mktemp("export")
    extra = ["--evaluation.before", "false", "--evaluation.exact_match_samples", "0", "--export.merged", "true"]
    proc = run_recipe(tiny_overrides(tmp, "llama", steps=5) + extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp / "out"


@pytest.fixture(scope="module")
def bf16(run, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("bf16") / "merged"
    proc = _module("hf_stable.cli", "export", str(run), "--out", str(out), "--dtype", "bfloat16")
    return out, proc


def _check(out: Path) -> dict:
    return json.loads((out / "export_check.json").read_text())


def test_recipe_export_is_standalone_and_verified_in_float32(run):
    out = run / "merged"
    check = _check(out)
    assert check["passed"] and check["problems"] == []
    assert check["dtype"] == "float32" and check["reference_source"] == "eval" and check["n_prompts"] == 16
    assert check["max_abs_logit_diff"] < 1e-5 and check["mean_kl"] < 1e-7 and check["top1_agreement"] == 1.0
    assert check["generations_equal"] == check["generations_total"] == 16
    assert not check["peft_imported"] and not check["config_has_quantization_config"]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    # the run's stop tokens, the tokenizer and its chat template travel with the weights
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == check["stop_token_ids_expected"]
    from transformers import PreTrainedTokenizerFast

    assert PreTrainedTokenizerFast.from_pretrained(out).chat_template
    # the numbers are in the run summary and in both model cards
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["export"]["check"]["passed"] and summary["export"]["dir"] == str(out)
    assert "## Merged export" in (run / "README.md").read_text()
    assert "| greedy generations equal | 16 of 16 |" in (out / "README.md").read_text()


def test_from_pretrained_alone_reproduces_the_recorded_logits(run):
    from transformers import AutoModelForCausalLM

    from hf_stable.export.reference import REFERENCE_FILE, answer_positions, read_reference

    meta, samples, ref = read_reference(run / REFERENCE_FILE)
    assert meta["base_fingerprint"]["sha256"] and meta["stop_token_ids"]
    model = AutoModelForCausalLM.from_pretrained(run / "merged").eval()
    start = 0
    with torch.no_grad():
        for s in samples:
            pos = answer_positions(s["labels"])
            logits = model(input_ids=torch.tensor([s["input_ids"]])).logits[0, pos]
            top = ref["topk_indices"][start : start + len(pos)].long()
            torch.testing.assert_close(
                logits.gather(-1, top), ref["topk_values"][start : start + len(pos)], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                torch.logsumexp(logits, -1), ref["logsumexp"][start : start + len(pos)], atol=1e-5, rtol=0
            )
            start += len(pos)
    assert start == ref["logsumexp"].numel()


def test_cli_exports_bfloat16_within_its_tolerance(bf16):
    out, proc = bf16
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported {out} (bfloat16)" in proc.stdout
    check = _check(out)
    assert check["passed"] and check["dtype"] == "bfloat16"
    # rounding to bf16 is visible but small; every greedy generation still matches on the tiny model
    assert 0 < check["max_abs_logit_diff"] < 0.1 and check["mean_kl"] < 1e-4
    assert check["generations_equal"] == 16
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = f.keys()
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}


def _copy(src: Path, tmp: Path) -> Path:
    dst = tmp / "corrupt"
    shutil.copytree(src, dst)
    return dst


def _verify(run: Path, merged: Path) -> tuple[subprocess.CompletedProcess, dict]:
    check_path = merged / "check.json"
    proc = _module(
        "hf_stable.export.verify",
        str(merged),
        "--reference",
        str(run / "export_reference.safetensors"),
        "--json",
        str(check_path),
    )
    return proc, json.loads(check_path.read_text())


def test_a_tampered_weight_and_a_wrong_stop_token_are_caught(run, tmp_path):
    """Both corruptions in one copy (one verification process): each is named by its own problem line."""
    from safetensors.torch import load_file, save_file

    merged = _copy(run / "merged", tmp_path)
    weights = load_file(merged / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.01 * torch.randn_like(weights[name])
    save_file(weights, merged / "model.safetensors", metadata={"format": "pt"})
    path = merged / "generation_config.json"
    gen = json.loads(path.read_text())
    gen["eos_token_id"] = [7]  # not the end token training taught
    path.write_text(json.dumps(gen))
    proc, check = _verify(run, merged)
    assert proc.returncode == 1 and not check["passed"]
    assert check["max_abs_logit_diff"] > 1e-3 and check["mean_kl"] > 1e-6
    assert check["stop_tokens_missing"] == check["stop_token_ids_expected"]
    assert "generation_config.json stops at [7]" in check["problems"][0]
    assert any(p.startswith("max |Δlogit|") for p in check["problems"]), check["problems"]


def test_another_base_is_refused_before_merging(run, tmp_path, capsys):
    """A run dir whose reference names another base's fingerprint: the export (and the recipe's) fails, naming it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hf_stable.config import load_config
    from hf_stable.errors import ExportError
    from hf_stable.export.exporter import export_after_training

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("merged"))
    ref = copy / "export_reference.safetensors"
    with safe_open(str(ref), framework="pt") as f:
        meta = json.loads(f.metadata()["hf_stable_reference"])
        names = f.keys()
        tensors = {k: f.get_tensor(k) for k in names}
    meta["base_fingerprint"]["sha256"] = "0" * 64
    save_file(tensors, str(ref), metadata={"hf_stable_reference": json.dumps(meta)})
    cfg = load_config(copy / "resolved_config.yaml", check=False)
    with pytest.raises(ExportError, match="is not the one .* trained on"):
        export_after_training(cfg, copy)
    assert not (copy / "merged").exists()
    from hf_stable.cli import main

    assert main(["export", str(copy)]) == 2
    assert "error: model.name_or_path:" in capsys.readouterr().err


def test_tiny_qwen3_with_its_chat_template_exports_and_verifies(tmp_path):
    # tied embeddings, q/k norms and the base's chat template, whose end of turn is a stop token
    extra = ["--evaluation.before", "false", "--evaluation.exact_match_samples", "0", "--export.merged", "true"]
    extra += ["--export.dtype", "bfloat16", "--export.reference_prompts", "8"]
    proc = run_recipe(tiny_overrides(tmp_path, "qwen3", steps=3) + extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / "out" / "merged"
    check = _check(out)
    assert check["passed"] and check["problems"] == [] and check["dtype"] == "bfloat16"
    assert check["generations_total"] == 8 and check["mean_kl"] < 1e-2
    from transformers import PreTrainedTokenizerFast

    # the template and the stop tokens the run trained with travel with the weights
    tok, trained = (PreTrainedTokenizerFast.from_pretrained(d) for d in (out, tmp_path / "out"))
    assert tok.chat_template and tok.chat_template == trained.chat_template
    conversation = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(conversation, tokenize=False) == trained.apply_chat_template(
        conversation, tokenize=False
    )
    stops = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert stops == json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"]
