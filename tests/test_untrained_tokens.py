"""Untrained template-token rows (issue 33): the detector flags a zeroed end-of-turn row and a constant-init role
marker and nothing on the project's embedded bases; `model.untrained_tokens: repair` sets them to the trained rows'
mean before LoRA, records it (summary, card, doctor, `untrained_token_repair.safetensors`) and `hf-stable export`
writes the repaired rows into the merged checkpoint; `train` hands the rows to peft's `trainable_token_indices`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from hf_stable.embeddings import (
    REPAIR_FILE,
    embedding_matrices,
    find_untrained_tokens,
    handle_untrained_tokens,
    special_token_ids,
    trainable_token_indices,
    used_special_tokens,
)
from tests.dist_scripts.harness import data_files, session_dir
from tests.helpers import TINY, make_tiny_model
from tests.test_recipe import run_recipe

EOT, ROLE = "<|end_of_text|>", "<|assistant|>"


def _data(tokenizer) -> types.SimpleNamespace:
    """A stand-in DataBundle: one rendered chat sample (BOS, role markers, answer, EOS as end of turn)."""
    messages = [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return types.SimpleNamespace(
        train_dataset={"input_ids": [ids]}, eval_dataset=None, stop_token_ids=[tokenizer.eos_token_id]
    )


def _break(embed: torch.Tensor, head: torch.Tensor | None, eot: int, role: int) -> None:
    """Zero the end-of-turn rows (embedding and lm_head); leave the role marker at a constant init whose norm is the
    median's (so only the constant rule can catch it)."""
    with torch.no_grad():
        embed[eot] = 0
        if head is not None:
            head[eot] = 0
        embed[role] = embed.float().norm(dim=1).median() / embed.shape[1] ** 0.5


def _trained_mean(weight: torch.Tensor, tokenizer) -> torch.Tensor:
    """The mean of the ordinary rows (non-special tokens, non-zero), computed here independently."""
    specials = set(special_token_ids(tokenizer))
    rows = [i for i in range(len(tokenizer)) if i not in specials and weight[i].abs().max() > 0]
    return weight[rows].float().mean(dim=0)


def test_detector_flags_zeroed_and_constant_rows_then_repair_and_train(tokenizer):
    from peft.utils.other import TrainableTokensWrapper

    from hf_stable.config.model import LoraSection
    from hf_stable.modeling import apply_lora

    model = make_tiny_model("llama", tokenizer)  # untied: the lm_head is checked too
    eot, role = tokenizer.convert_tokens_to_ids([EOT, ROLE])
    _break(model.get_input_embeddings().weight, model.get_output_embeddings().weight, eot, role)
    data = _data(tokenizer)
    assert set(used_special_tokens(tokenizer, data).values()) == {"<|begin_of_text|>", "<|user|>", ROLE, EOT}

    found = find_untrained_tokens(embedding_matrices(model), tokenizer, used_special_tokens(tokenizer, data))
    reasons = {(r.token, r.matrix): r.reason for r in found.rows}
    assert reasons == {
        (EOT, "input_embedding"): "all zeros",
        (EOT, "lm_head"): "all zeros",
        (ROLE, "input_embedding"): "constant (every entry equal)",
    }

    embed_mean = _trained_mean(model.get_input_embeddings().weight, tokenizer)
    found = handle_untrained_tokens(model, tokenizer, data, "train")
    emb = model.get_input_embeddings().weight
    torch.testing.assert_close(emb[eot], embed_mean) and torch.testing.assert_close(emb[role], embed_mean)
    assert emb[eot].norm() > 0 and found.repaired and found.names() == [EOT, ROLE]
    # a repaired row (the mean: a small norm, shared by every repaired token) is not flagged again
    again = find_untrained_tokens(embedding_matrices(model), tokenizer, {eot: EOT, role: ROLE})
    assert again.rows == []

    indices = trainable_token_indices(model, found)
    assert indices == {"model.embed_tokens": [eot, role], "lm_head": [eot]}
    peft_model = apply_lora(model, LoraSection(r=4, target_modules=["q_proj"]), trainable_tokens=indices)
    wrapped = peft_model.get_base_model().get_input_embeddings()
    assert isinstance(wrapped, TrainableTokensWrapper)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad and "trainable_tokens" in n]
    assert len(trainable) == 2  # the embedding rows and the untied lm_head row


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_no_false_positive_on_embedded_bases(arch):
    from transformers import AutoModelForCausalLM

    from hf_stable.config.data import DataConfig
    from hf_stable.config.model import ModelConfig
    from hf_stable.data import build_data
    from hf_stable.embedded.builder import ensure_base
    from hf_stable.modeling import load_tokenizer

    base = ensure_base(arch, _tiny_base_config())
    tok = load_tokenizer(ModelConfig(name_or_path=f"embedded:tiny-{arch}"), str(base))
    train, held = data_files(64)
    data = build_data(DataConfig(train_file=str(train), eval_file=str(held), audit=False), tok)
    model = AutoModelForCausalLM.from_pretrained(base)
    found = find_untrained_tokens(embedding_matrices(model), tok, used_special_tokens(tok, data))
    assert EOT in found.candidates.values() and ROLE in found.candidates.values()
    assert found.rows == [], found.describe()


def _tiny_base_config():
    # the same base the harness' recipe runs build (tiny_base_args with 20 pretraining steps): shared in the session
    return dataclasses.replace(TINY, pretrain_steps=20, pretrain_batch_size=8, cache_dir=str(session_dir() / "bases"))


@pytest.fixture(scope="module")
def repaired_run(tmp_path_factory) -> tuple[Path, Path, str]:
    """A 2-step recipe run with a merged export on a copy of the tiny Llama whose end-of-turn rows are zeroed and
    whose assistant marker is at a constant init."""
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    from hf_stable.embedded.builder import ensure_base

    tmp = tmp_path_factory.mktemp("untrained")
    broken = tmp / "broken-base"
    shutil.copytree(ensure_base("llama", _tiny_base_config()), broken)
    tok = PreTrainedTokenizerFast.from_pretrained(broken / "tokenizer")
    weights = load_file(broken / "model.safetensors")
    eot, role = tok.convert_tokens_to_ids([EOT, ROLE])
    _break(weights["model.embed_tokens.weight"], weights["lm_head.weight"], eot, role)
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})

    train, held = data_files(64)
    args = ["--model.name_or_path", str(broken), "--data.train_file", str(train), "--data.eval_file", str(held)]
    args += ["--evaluation.before", "false", "--evaluation.exact_match_samples", "0", "--export.merged", "true"]
    args += ["--export.reference_prompts", "4", "--export.max_new_tokens", "4", "--training.max_steps", "2"]
    args += ["--doctor", "true", "--doctor_checks.dry_run", "false"]
    # repair alone (the default, `train`, repairs then trains the rows: the merged rows are then the trained ones):
    # the repaired rows must reach the export exactly
    args += ["--model.untrained_tokens", "repair"]
    args += ["--training.per_device_train_batch_size", "8", "--training.output_dir", str(tmp / "out")]
    proc = run_recipe(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return broken, tmp / "out", proc.stdout + proc.stderr


def test_recipe_repairs_records_and_export_applies(repaired_run):
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    broken, out, log = repaired_run
    tok = PreTrainedTokenizerFast.from_pretrained(broken / "tokenizer")
    eot, role = tok.convert_tokens_to_ids([EOT, ROLE])
    base = load_file(broken / "model.safetensors")
    embed_mean = _trained_mean(base["model.embed_tokens.weight"], tok)
    head_mean = _trained_mean(base["lm_head.weight"], tok)
    assert f"untrained tokens {EOT}, {ROLE}: set to the trained rows' mean" in log

    # the adapter output carries the repaired rows: the trained rows' mean, non-zero
    saved = load_file(out / REPAIR_FILE)
    assert saved["input_embedding.ids"].tolist() == [eot, role] and saved["lm_head.ids"].tolist() == [eot]
    torch.testing.assert_close(saved["input_embedding.rows"], embed_mean.expand(2, -1))
    torch.testing.assert_close(saved["lm_head.rows"][0], head_mean)
    assert embed_mean.norm() > 0

    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["untrained_tokens"]["tokens"] == [EOT, ROLE] and summary["untrained_tokens"]["repaired"]
    card = (out / "README.md").read_text()
    assert "### Untrained template tokens" in card and 'apply_repair(base, "<this directory>")' in card
    doctor = json.loads((out / "doctor_report.json").read_text())
    finding = next(f for f in doctor["findings"] if f["check"] == "hazards.untrained_tokens")
    assert finding["severity"] == "info" and EOT in finding["what"] and "mean of the trained rows" in finding["fix"]

    # the export wrote the repaired rows into the base before merging (the embedding and lm_head are not LoRA
    # targets, so the merged rows are exactly the repaired ones) and verifies against the model as trained
    merged = load_file(out / "merged" / "model.safetensors")
    torch.testing.assert_close(merged["model.embed_tokens.weight"][[eot, role]], saved["input_embedding.rows"])
    torch.testing.assert_close(merged["lm_head.weight"][eot], saved["lm_head.rows"][0])
    assert json.loads((out / "merged" / "export_check.json").read_text())["passed"]
    assert "this checkpoint carries the repair" in (out / "merged" / "README.md").read_text()


def test_doctor_alone_reads_the_rows_from_disk(repaired_run):
    from hf_stable.config import load_config
    from hf_stable.doctor import run_doctor

    broken, _, _ = repaired_run
    train, held = data_files(64)
    for mode, severity in (("repair", "info"), ("ignore", "warning")):
        argv = ["--model.name_or_path", str(broken), "--data.train_file", str(train), "--data.eval_file", str(held)]
        cfg = load_config(argv=[*argv, "--model.untrained_tokens", mode])
        (finding,) = run_doctor(cfg, dry_run=False).by_check("hazards.untrained_tokens")
        assert finding.severity == severity and finding.what == f"untrained embedding rows for {EOT}, {ROLE}"
        assert "input_embedding all zeros" in finding.evidence and "lm_head all zeros" in finding.evidence
