"""End to end: scripts/finetune.py on tiny embedded Llama / Qwen2 / Qwen3 bases, outputs, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_scripts.harness import tiny_base_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "finetune.py"

pytestmark = pytest.mark.slow


def tiny_overrides(tmp: Path, arch: str = "llama", steps: int = 6, n_train: int = 96) -> list[str]:
    """A seconds-long version of the default recipe: small base, few records, few steps."""
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    train = (ROOT / "data/embedded/train.jsonl").read_text(encoding="utf-8").split("\n")[:n_train]
    (data / "train.jsonl").write_text("\n".join(train) + "\n", encoding="utf-8")
    held = (ROOT / "data/embedded/eval.jsonl").read_text(encoding="utf-8").split("\n")[:16]
    (data / "eval.jsonl").write_text("\n".join(held) + "\n", encoding="utf-8")
    return [
        "--model.name_or_path",
        f"embedded:tiny-{arch}",
        *tiny_base_args(tmp.parent / "bases", pretrain_steps=20),
        "--data.train_file",
        str(data / "train.jsonl"),
        "--data.eval_file",
        str(data / "eval.jsonl"),
        "--evaluation.exact_match_samples",
        "8",
        "--evaluation.max_new_tokens",
        "8",
        "--training.max_steps",
        str(steps),
        "--training.logging_steps",
        "2",
        "--training.per_device_train_batch_size",
        "8",
        "--training.output_dir",
        str(tmp / "out"),
    ]


def run_recipe(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    proc = run_recipe(tiny_overrides(tmp, "llama"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp / "out", proc


def test_the_run_prints_no_kernels_notice(llama_run):
    """peft imports bitsandbytes, which warns at import that the optional `kernels` package (a fused CPU 4-bit
    kernel) is missing: noise in a run without 4-bit layers, quieted by `hf_stable.logging`."""
    _, proc = llama_run
    assert not [line for line in (proc.stdout + proc.stderr).splitlines() if "kernels" in line]


def test_outputs_are_complete(llama_run):
    out, proc = llama_run
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "trainer_state.json",
        "resolved_config.yaml",
        "run_summary.json",
        "README.md",
        "optimizer_groups.json",
        "generation_config.json",
    ):
        assert (out / name).is_file(), f"missing {name}"
    assert not (out / "RUN_INCOMPLETE.json").exists()
    summary = json.loads((out / "run_summary.json").read_text())
    for key in ("eval_loss_before", "eval_loss_after", "exact_match_before", "exact_match_after", "wall_seconds"):
        assert summary[key] is not None, key
    assert summary["train_steps"] == 6
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert str(out.resolve()) in proc.stdout


def test_model_card_has_metadata_and_plot(llama_run):
    from huggingface_hub import ModelCard

    out, _ = llama_run
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "peft"
    assert card.data.base_model == "embedded:tiny-llama"
    assert "hf_stable" in card.data.tags
    assert "![loss and learning rate](plots/loss_lr.png)" in card.text
    png = out / "plots" / "loss_lr.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _base_and_inputs(out: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    summary_cfg = (out / "resolved_config.yaml").read_text()
    assert "tiny-llama" in summary_cfg
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(adapter_cfg["base_model_name_or_path"])
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    ids = tok(["What is 3 + 4?", "把 3 千米换算成米。"], return_tensors="pt", padding=True)
    return base, PeftModel, ids


def test_adapter_reload_gives_identical_logits_and_merge_matches(llama_run):
    out, _ = llama_run
    base, PeftModel, ids = _base_and_inputs(out)
    with torch.no_grad():
        base_logits = base(**ids).logits.clone()
        model = PeftModel.from_pretrained(base, out)
        model.eval()
        adapted = model(**ids).logits
        again = model(**ids).logits
        assert torch.equal(adapted, again)
        assert not torch.allclose(adapted, base_logits), "the adapter changed nothing"
        merged = model.merge_and_unload()
        merged_logits = merged(**ids).logits
    torch.testing.assert_close(merged_logits, adapted, atol=1e-5, rtol=1e-5)


def test_the_same_command_into_a_finished_run_stops_with_one_line(llama_run):
    out, _ = llama_run
    tmp = out.parent
    adapter = (out / "adapter_model.safetensors").read_bytes()
    proc = run_recipe(tiny_overrides(tmp, "llama"))  # the same command again, into the finished run's dir
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc_tail(proc)
    assert errors[0].startswith(f"error: training.output_dir: {out} holds a finished run"), errors
    assert "--runtime.overwrite true" in errors[0] and f"--training.output_dir {out}-2" in errors[0]
    assert (out / "adapter_model.safetensors").read_bytes() == adapter and (out / "run_summary.json").is_file()
    assert not (out / "RUN_INCOMPLETE.json").exists() and not list(out.glob("replaced-*"))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_recipe_runs_on_qwen_bases(tmp_path, arch):
    proc = run_recipe(tiny_overrides(tmp_path, arch, steps=4, n_train=48))
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["base_model"] == f"embedded:tiny-{arch}" and summary["train_steps"] == 4
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


# ---- bad input: one clear message, exit code != 0, no traceback, nothing that looks finished ----------


def proc_tail(proc) -> str:
    return proc.stderr[-3000:]


def failure_problems(proc, *needles) -> list[str]:
    """What is wrong with a failed run's exit: zero exit code, a traceback, or a missing piece of the message."""
    problems = [] if proc.returncode != 0 else ["exit code 0"]
    if "Traceback" in proc.stderr:
        problems.append("traceback on stderr")
    problems += [f"{needle!r} not in the message" for needle in needles if needle not in proc.stderr]
    return problems


def test_missing_config_file(tmp_path):
    proc = run_recipe(["--config", str(tmp_path / "nope.yaml")])
    assert failure_problems(proc, "config file not found", "nope.yaml") == [], proc_tail(proc)


def test_missing_data_file(tmp_path):
    args = tiny_overrides(tmp_path) + ["--data.train_file", str(tmp_path / "missing.jsonl")]
    proc = run_recipe(args)
    assert failure_problems(proc, "missing.jsonl", "data.train_file") == [], proc_tail(proc)
    out = tmp_path / "out"
    assert not (out / "run_summary.json").exists() and not (out / "README.md").exists()
    assert json.loads((out / "RUN_INCOMPLETE.json").read_text())["status"] == "failed"


def test_malformed_jsonl_line_and_missing_field(tmp_path):
    args = tiny_overrides(tmp_path)
    bad = tmp_path / "bad.jsonl"
    lines = (tmp_path / "data" / "train.jsonl").read_text(encoding="utf-8").split("\n")[:5]
    lines[2] = '{"instruction": "broken", "input": ""'  # line 3: malformed JSON
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = run_recipe(args + ["--data.train_file", str(bad)])
    assert failure_problems(proc, f"{bad}:3") == [], proc_tail(proc)
    lines[2] = '{"instruction": "no output here", "input": ""}'  # line 3: missing field
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = run_recipe(args + ["--data.train_file", str(bad)])
    assert failure_problems(proc, f"{bad}:3", "output") == [], proc_tail(proc)


def test_model_path_that_does_not_exist(tmp_path):
    args = tiny_overrides(tmp_path) + ["--model.name_or_path", str(tmp_path / "no_model")]
    proc = run_recipe(args)
    assert failure_problems(proc, "model.name_or_path", "no_model", "does not exist") == [], proc_tail(proc)


def test_bad_config_value_lists_every_problem(tmp_path):
    proc = run_recipe(["--lora.r", "zero", "--training.learning_rat", "1"])
    assert failure_problems(proc, "2 configuration problem(s)", "lora.r", "training.learning_rat") == [], proc_tail(
        proc
    )


def test_console_shows_compact_lines_and_logs_keep_every_metric(llama_run):
    out, proc = llama_run
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert lines and all(" | loss " in line for line in lines if "train_runtime" not in line and "eval_" not in line)
    assert not any("grad/norm/" in line for line in proc.stdout.splitlines())  # per-group detail stays in the logs
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert any("grad/norm/layer_0.lora_B" in h for h in history)
