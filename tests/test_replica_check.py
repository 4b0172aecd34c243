"""The replica-consistency check: ranks whose weights diverged are found, named, and the run stops with exit 1.

The 2-rank runs go through the recipe (tests/dist_scripts/recipe_probe.py): rank 1 alone adds 1e-3 to one LoRA
weight at the end of step 3 (`perturb:3:1`), and the check every 2 steps must find it at step 4.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_stable.callbacks.monitors import replica_check
from hf_stable.callbacks.monitors.replica_check import ReplicaCheck, compare_replicas, weight_checksums
from hf_stable.core.engine import DeepSpeedEngine, FSDP2Engine, StepEngine
from hf_stable.outputs import INCOMPLETE_FILE
from tests.dist_scripts.harness import CPU, ddp_reference_run, launch, recipe_args
from tests.helpers import make_tiny_model


def _events(out) -> list[dict]:
    path = out / "stability_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_checksums_tell_a_one_ulp_change_and_name_the_rank_and_parameter():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(64, 8, generator=g), torch.randn(8, 64, generator=g).bfloat16(), torch.randn(5).double()]
    names = ["a", "b", "c"]
    same = weight_checksums([w.clone() for w in weights])
    assert torch.equal(same, weight_checksums(weights))
    # the sum of the bit patterns is exact and order-free: a reversed layout of the same values sums the same
    assert weight_checksums([weights[0].flip(0).contiguous()])[0] == same[0]
    changed = [w.clone() for w in weights]
    changed[1].view(torch.int16).view(-1)[3] += 1  # one bf16 element, one ulp
    other = weight_checksums(changed)
    assert compare_replicas(torch.stack([same, same, same]), names) is None
    verdict = compare_replicas(torch.stack([same, other, same, other]), names)
    assert verdict["parameter"] == "b" and verdict["ranks"] == [1, 3] and verdict["n_differing"] == 1


def test_the_engine_seam_says_where_weights_are_replicated():
    assert StepEngine().replicated_weights  # plain / DDP
    assert DeepSpeedEngine(stage=1).replicated_weights and DeepSpeedEngine(stage=2).replicated_weights
    assert not DeepSpeedEngine(stage=3).replicated_weights and not FSDP2Engine().replicated_weights


def test_one_process_is_a_no_op_without_a_collective(tokenizer, tmp_path, monkeypatch):
    def no_collective(*a, **k):
        raise AssertionError("one process must not gather")

    monkeypatch.setattr(replica_check, "all_gather_tensor", no_collective)
    model = make_tiny_model("llama", tokenizer)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(3, 100, (16,), generator=g)), "labels": ids} for _ in range(12)]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    check = ReplicaCheck(interval=1)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[check]).train()
    assert check.checks == 0 and not check.events and not _events(tmp_path)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_weight_changed_on_rank_1_is_found_named_and_stops_both_ranks(tmp_path):
    out = tmp_path / "out"
    args = recipe_args(out, steps=6, n_train=96) + CPU + ["--stability.monitors.replica_check.interval", "2"]
    run = launch(args, out, nproc=2, fault="perturb:3:1", timeout=240)
    assert run.returncode == 1, run.tail()
    assert run.exit_codes() == {0: 1, 1: 1}, run.tail()
    assert "rank 1 perturbed base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in run.output
    (event,) = [e for e in _events(out) if e["kind"] == "replica_mismatch"]
    parameter = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert event["step"] == 4 and event["severity"] == "error"  # the first check after step 3
    assert event["ranks"] == [0, 1] and event["parameter"] == parameter and event["n_differing"] == 1
    assert event["last_agreed_step"] == 2  # the check at step 2 (and at train start) agreed
    # one message, printed once (rank 0 speaks for both), naming the rank, the parameter and where to resume from
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "replica mismatch at step 4" in lines[0] and "rank 1" in lines[0], run.stderr[-3000:]
    assert parameter in lines[0] and "they last agreed at step 2" in lines[0]
    assert "Traceback (most recent call last)" not in run.stderr.split("error: replica mismatch")[0]
    status = json.loads((out / INCOMPLETE_FILE).read_text())
    assert status["status"] == "failed" and status["reason"] == "replica mismatch"
    assert parameter in status["error"]
    assert not (out / "checkpoint-6").exists() and not (out / "adapter_model.safetensors").exists()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_clean_two_rank_run_checks_and_writes_no_mismatch():
    run = ddp_reference_run()  # shared with the DDP / launcher tests
    assert not [e for e in _events(run.out) if e["kind"] == "replica_mismatch"]
    for rank in run.ranks():
        state = rank["callbacks"]["ReplicaCheck"]["state"]
        assert state == {"last_agreed": 0, "checks": 1}  # at train start (the default interval is past step 6)
