"""The whole stability machinery under every engine: DDP, DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 on 2 gloo ranks.

One `torchrun` per engine (tests/dist_scripts/engines_run.py: `StableTrainer`, the default guards, a gradient
monitor every step) on the same data and initial weights, with faults on rank 1 only: a NaN loss at step 4, and
after step 9 rank 1's part of every LoRA B is NaN, so steps 10 and 11 are bad and the rollback guard restores the
step-0 snapshot at 11. Every engine must take DDP's decisions, report DDP's gradient norms (the sums of the ranks'
shards/partitions), leave each rank's weights *and optimizer state* bitwise unchanged over a skipped step, restore
the snapshot bitwise, keep the LR schedule on `global_step`, switch nothing off, and end with identical ranks.

FSDP2 runs through accelerate and the stock Trainer path with a test-only switch (`dist_scripts/fsdp_cpu.py`:
accelerate makes FSDP states only for GPU-like devices); see its docstring for what only a GPU run exercises.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from tests.dist_scripts.harness import session_dir, torchrun_two_ranks

SCRIPT = Path(__file__).parent / "dist_scripts" / "engines_run.py"
ENGINES = ["zero2", "zero3", "fsdp2"]


@functools.cache
def run(engine: str, stock: bool = False) -> tuple[list[dict], list[list[torch.Tensor]]]:
    out = session_dir() / f"engines_{engine}{'_stock' if stock else ''}"
    extra = ["stock"] if stock else []
    torchrun_two_ranks(SCRIPT, engine, str(out), *extra, timeout=300, env={"ENGINES_TIMEOUT": "240"})
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)]
    weights = [torch.load(out / f"rank{i}.pt") for i in (0, 1)]
    return ranks, weights


def _check_run(ranks: list[dict], weights: list) -> None:
    for r in ranks:
        assert r["world_size"] == 2
        assert r["skipped"] == [4, 10, 11]  # step 4: NaN loss on rank 1 only; 10-11: rank 1's weights damaged
        assert r["unchanged_over_skip"]["4"] and r["unchanged_over_skip"]["10"]  # weights + optimizer state
        assert r["rollbacks"] == [[11, 0]] and r["restored"] == [True] and r["lr_factor"] == pytest.approx(0.5)
        assert r["finite"] and r["global_step"] == 14
        assert not [e for e in r["events"] if e["kind"].endswith("_off")]
    assert [e["kind"] for e in ranks[0]["events"]] == [e["kind"] for e in ranks[1]["events"]]
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))  # the full weights, gathered


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(400)
def test_ddp_reference_run_skips_restores_and_keeps_ranks_identical():
    ranks, weights = run("ddp")
    assert ranks[0]["engine"] == "ddp"
    _check_run(ranks, weights)


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("engine", ENGINES)
def test_sharded_engine_takes_the_ddp_decisions_with_the_ddp_norms(engine):
    ranks, weights = run(engine)
    ref, ref_weights = run("ddp")
    assert ranks[0]["engine"] == {"zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3", "fsdp2": "fsdp2"}[engine]
    _check_run(ranks, weights)
    for r in ranks:  # every step's global and per-group norms: the sums of the parts equal DDP's full gradients
        assert r["norms"].keys() == ref[0]["norms"].keys()
        for step, norms in ref[0]["norms"].items():
            for key, value in norms.items():
                got = r["norms"][step][key]
                assert (math.isnan(got) and math.isnan(value)) or got == pytest.approx(value, rel=1e-5), (step, key)
        # the schedule advanced over every skip (DeepSpeed's own overflow skip holds it back a step)
        assert r["lrs"] == pytest.approx(ref[0]["lrs"], rel=1e-6)
    for got, want in zip(weights[0], ref_weights[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_the_stock_trainer_under_fsdp2_runs_the_guards_as_stable_trainer_does():
    """Under FSDP2 the stock Trainer calls on_pre_optimizer_step between backward and optimizer.step: the same
    callbacks skip, roll back and keep the ranks identical without StableTrainer."""
    ranks, weights = run("fsdp2", stock=True)
    ref, _ = run("ddp")
    _check_run(ranks, weights)
    assert ranks[0]["lrs"] == pytest.approx(ref[0]["lrs"], rel=1e-6)


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(400)
def test_the_stock_trainer_under_deepspeed_says_once_that_the_guards_cannot_act():
    """DeepSpeed steps inside backward: a stock Trainer's callbacks come after the update. One `guard_off` event
    points to StableTrainer; no guard pretends (no skip, no rollback), and DeepSpeed's own overflow skip handles
    the NaN step."""
    ranks, _ = run("zero2", stock=True)
    for r in ranks:
        off = [e for e in r["events"] if e["kind"].endswith("_off")]
        assert len(off) == 1 and "StableTrainer" in off[0]["message"]
        assert r["skipped"] == [] and r["rollbacks"] == [] and r["norms"] == {}
