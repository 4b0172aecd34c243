"""`stage: dpo` end to end: a tiny SFT run, then configs/dpo.yaml from its output dir for a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_scripts.harness import tiny_base_args

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "finetune.py"


def _slice(src: str, dst: Path, n: int) -> str:
    lines = (ROOT / "data" / "embedded" / src).read_text(encoding="utf-8").split("\n")[:n]
    dst.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(dst)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    base = tiny_base_args(tmp.parent / "bases", pretrain_steps=20)
    sft = _run(
        [
            *base,
            "--data.train_file",
            _slice("train.jsonl", tmp / "train.jsonl", 96),
            "--data.eval_file",
            _slice("eval.jsonl", tmp / "eval.jsonl", 8),
            "--evaluation.before",
            "false",
            "--evaluation.exact_match_samples",
            "0",
            "--training.max_steps",
            "6",
            "--training.per_device_train_batch_size",
            "8",
            "--training.output_dir",
            str(tmp / "sft"),
        ]
    )
    assert sft.returncode == 0, sft.stdout[-2000:] + sft.stderr[-4000:]
    dpo = _run(
        [
            "--config",
            "configs/dpo.yaml",
            *base,
            "--model.start_from",
            str(tmp / "sft"),
            "--data.train_file",
            _slice("pairs_train.jsonl", tmp / "pairs_train.jsonl", 48),
            "--data.eval_file",
            _slice("pairs_eval.jsonl", tmp / "pairs_eval.jsonl", 16),
            "--training.max_steps",
            "3",
            "--training.per_device_train_batch_size",
            "8",
            "--training.learning_rate",
            "1e-3",
            "--training.output_dir",
            str(tmp / "dpo"),
        ]
    )
    assert dpo.returncode == 0, dpo.stdout[-2000:] + dpo.stderr[-4000:]
    return tmp / "sft", tmp / "dpo", dpo


def test_dpo_moves_the_adapter_and_keeps_the_reference(dpo_run):
    import torch
    from safetensors.torch import load_file

    sft, dpo, _ = dpo_run
    before, after = (
        load_file(str(sft / "adapter_model.safetensors")),
        load_file(str(dpo / "adapter_model.safetensors")),
    )
    assert before.keys() == after.keys()
    assert all(torch.isfinite(t).all() for t in after.values())
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-6  # the SFT adapter was trained further
    summary = json.loads((dpo / "run_summary.json").read_text())
    ref = summary["reference"]
    assert ref["kind"] == "adapter copy ('ref')" and ref["source"] == str(sft) and ref["tensors"] == len(before)
    assert ref["max_abs_diff"] == 0.0 and ref["max_abs_diff_after_training"] == 0.0  # the SFT model, frozen
    assert not (dpo / "ref").exists()  # the reference copy is not saved as a second adapter
    stops = json.loads((dpo / "generation_config.json").read_text())["eos_token_id"]
    assert stops == json.loads((sft / "generation_config.json").read_text())["eos_token_id"]  # stops as after SFT


def test_summary_has_preference_metrics_and_the_card_names_the_chain(dpo_run):
    _, dpo, proc = dpo_run
    summary = json.loads((dpo / "run_summary.json").read_text())
    assert summary["stage"] == "dpo" and summary["stage_chain"] == ["sft", "dpo"] and summary["train_steps"] == 3
    before, after = summary["preference"]["before"], summary["preference"]["after"]
    for metrics in (before, after):
        assert 0.0 <= metrics["preference_accuracy"] <= 1.0
        assert metrics["chosen_logp_per_token"] < 0 and "rewards/margins" in metrics
    assert before["rewards/accuracies"] == 0.0 and before["rewards/margins"] == 0.0  # policy == reference at start
    assert after["rewards/margins"] != 0.0
    assert summary["data"]["train"] == {"read": 48, "kept": 48, "dropped": 0, "dropped_reasons": {}}
    card = (dpo / "README.md").read_text(encoding="utf-8")
    assert "**Stage chain:** embedded:tiny-llama → SFT → DPO" in card
    assert "held-out preference accuracy" in proc.stderr + proc.stdout
