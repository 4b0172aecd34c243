"""scripts/finetune.py on two real CPU ranks (gloo): DDP with a preemption + resume, DeepSpeed ZeRO-2 and ZeRO-3.

The ZeRO runs are the default recipe's (`harness.engine_runs`, shared with tests/test_distributed_engines.py).

Each launch goes through tests/dist_scripts/recipe_probe.py, which records per rank the dataset rows of every
batch, the final LoRA tensors, the hf_stable callbacks' events and states, and the in-memory logits.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_stable.checkpoints import MARKER_FILE, checkpoint_problems
from tests.dist_scripts.harness import (
    PROBE_INPUT_IDS,
    ddp_args,
    ddp_reference_run,
    engine_runs,
    launch,
    load_adapter,
    strip_timing,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(400)]

VOLATILE = ("perf/", "mem/", "hw/")


def _stable_logs(history: list[dict]) -> list[dict]:
    """Log entries without what legitimately differs between ranks: wall-clock values, and the Trainer's final
    `train_loss`, whose steps since the last logging step are averaged on each rank without an all-reduce."""

    def keep(key: str) -> bool:
        return (
            not key.startswith(VOLATILE) and "runtime" not in key and "per_second" not in key and key != "train_loss"
        )

    return [{k: v for k, v in row.items() if keep(k)} for row in history]


def _without_time(events: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "time"} for e in events]


def _file_events(out) -> list[dict]:
    path = out / "stability_events.jsonl"
    return _without_time([json.loads(line) for line in path.read_text().splitlines()]) if path.is_file() else []


def _peft_names(tensors: dict) -> dict:
    """In-memory LoRA names carry the adapter name (`.default`); saved files do not."""
    return {k.replace(".default", ""): v for k, v in tensors.items()}


# ---- DDP: rank 1 alone gets SIGTERM at step 2; both stop at step 3; a relaunch finishes the epoch -------------


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "out"
    args = ddp_args(out)
    first = launch(args, out, nproc=2, fault="sigterm:2:1", tag="first")
    # the relaunch uses the CPU accelerate config, which must start two real ranks too
    second = launch(args, out, nproc=2, tag="second", accelerate_config="configs/accelerate/cpu-2proc.yaml")
    return out, first, second


def test_ddp_preempted_and_resumed_run_equals_an_uninterrupted_one(ddp):
    out, _, second = ddp
    assert second.returncode == 0, second.tail()
    a, b = load_adapter(out), load_adapter(ddp_reference_run().out)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise, across a preemption on 2 ranks


def test_ddp_preemption_on_one_rank_stops_every_rank_at_the_same_step(ddp):
    out, first, _ = ddp
    assert first.exit_codes() == {0: 143, 1: 143}, first.tail()
    ranks = first.ranks()
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["global_step"] for r in ranks] == [3, 3]  # rank 0 never got the signal but stopped with rank 1
    ckpt = out / "checkpoint-3"
    assert checkpoint_problems(ckpt) == []
    listed = json.loads((ckpt / MARKER_FILE).read_text())["files"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(listed)  # the marker waited for both ranks
    assert (
        ranks[0]["callbacks"]["PreemptionCallback"]["events"] == ranks[1]["callbacks"]["PreemptionCallback"]["events"]
    )


def test_ddp_ranks_train_on_disjoint_equal_shares_and_resume_continues_the_order(ddp):
    _, first, second = ddp
    a, b = first.ranks(), second.ranks()
    for rank in (0, 1):
        assert all(len(batch) == 8 for batch in a[rank]["samples"] + b[rank]["samples"])
        # launch 1 prefetched the batch of step 4; the resumed launch trains on exactly that batch first
        assert a[rank]["samples"][3] == b[rank]["samples"][0]
    trained = [a[rank]["samples"][:3] + b[rank]["samples"][:3] for rank in (0, 1)]
    rows = [i for per_rank in trained for batch in per_rank for i in batch]
    assert len(rows) == 96 and sorted(rows) == list(range(96))  # one epoch: every row exactly once, split evenly
    per_rank = [{i for batch in batches for i in batch} for batches in trained]
    assert not per_rank[0] & per_rank[1] and len(per_rank[0]) == len(per_rank[1]) == 48


def test_ddp_final_adapter_identical_on_both_ranks_and_written_once(ddp):
    out, _, second = ddp
    assert second.returncode == 0, second.tail()
    r0, r1 = second.ranks()
    assert (r0["should_save"], r1["should_save"]) == (True, False)
    lora0 = torch.load(second.probe / "lora_rank0.pt")
    lora1 = torch.load(second.probe / "lora_rank1.pt")
    assert all(torch.equal(lora0[k], lora1[k]) for k in lora0)
    saved = load_adapter(out)
    assert all(torch.equal(saved[k], v) for k, v in _peft_names(lora0).items())
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # trained (lora_B starts at zero)
    assert second.output.count("done in") == 1  # printed by the main process only
    assert (out / "run_summary.json").is_file() and not (out / "RUN_INCOMPLETE.json").exists()


def test_ddp_decisions_identical_across_ranks_and_logs_written_once(ddp):
    out, first, second = ddp
    for run in (first, second):
        r0, r1 = run.ranks()
        assert r0["callbacks"].keys() == r1["callbacks"].keys()
        for name in r0["callbacks"]:
            assert r0["callbacks"][name]["events"] == r1["callbacks"][name]["events"], name
        states = [strip_timing({k: v["state"] for k, v in r["callbacks"].items()}) for r in (r0, r1)]
        assert states[0] == states[1]
        assert _stable_logs(r0["log_history"]) == _stable_logs(r1["log_history"])
    # the events file holds each event once: exactly what the main process emitted in the two launches
    emitted = [e for run in (first, second) for cb in run.ranks()[0]["callbacks"].values() for e in cb["events"]]
    assert sorted(map(json.dumps, _file_events(out))) == sorted(map(json.dumps, emitted))
    kinds = [e["kind"] for e in _file_events(out)]
    assert kinds.count("preemption") == 1 and "step_skipped" in kinds and "grad_explosion" in kinds
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    loss_steps = [h["step"] for h in history if "loss" in h]
    assert loss_steps == [2, 4, 6]
    assert all(math.isfinite(h["loss"]) for h in history if "loss" in h)


# ---- DeepSpeed --------------------------------------------------------------------------------------------


@pytest.mark.deepspeed
def test_zero2_trains_on_two_ranks_and_checkpoints_are_marked_after_every_shard():
    pytest.importorskip("deepspeed")
    (run,) = engine_runs("zero2")
    out = run.out
    assert run.returncode == 0, run.tail()
    r0, _ = run.ranks()
    assert (r0["deepspeed_stage"], r0["world_size"], r0["global_step"]) == (2, 2, 4)
    lora0, lora1 = torch.load(run.probe / "lora_rank0.pt"), torch.load(run.probe / "lora_rank1.pt")
    assert all(torch.equal(lora0[k], lora1[k]) for k in lora0)
    saved = load_adapter(out)
    assert all(torch.equal(saved[k], v) for k, v in _peft_names(lora0).items())
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)
    losses = [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    for step in (2, 4):
        ckpt = out / f"checkpoint-{step}"
        assert checkpoint_problems(ckpt) == []
        listed = json.loads((ckpt / MARKER_FILE).read_text())["files"]
        shards = [f for f in listed if "optim_states" in f]
        assert len(shards) == 2 and any("rank_1" in f for f in shards), listed  # each rank's ZeRO shard


@pytest.mark.deepspeed
def test_zero3_lora_save_reload_merge_gives_the_in_memory_logits():
    pytest.importorskip("deepspeed")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = engine_runs("zero3")[-1]  # the launch that resumed after a preemption and finished
    out = run.out
    assert run.returncode == 0, run.tail()
    r0, _ = run.ranks()
    assert r0["deepspeed_stage"] == 3 and r0["params_partitioned"]  # really ZeRO-3, not a silent fallback
    gathered = _peft_names(torch.load(run.probe / "lora_rank0.pt"))
    saved = load_adapter(out)
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(v.shape) for k, v in gathered.items()}
    assert all(v.numel() > 0 for v in saved.values())  # the ZeRO-3 pitfall: partitioned tensors saved as size 0
    assert all(torch.equal(saved[k], gathered[k]) for k in saved)

    in_memory = torch.load(run.probe / "logits.pt")  # the ZeRO-3 engine's own forward at the end of training
    base_path = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    ids = torch.tensor(PROBE_INPUT_IDS)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, out).eval()
        reloaded = model(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(reloaded, in_memory, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, in_memory, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(base_logits, in_memory, atol=1e-3)  # the adapter matters
