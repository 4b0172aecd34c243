"""The collectives hf_stable adds per optimizer step on 2 gloo ranks, with the recipe's default monitors and guards:
one a step (the statistics' gather, where the skip guard reads them; the monitors listed before it read the same
report), checks that run at an interval counted apart (the memory and throughput monitors at logging steps), a
failing step's own reduce. A NaN written into one rank's gradient between the monitors and the guards is still
skipped on both ranks, and with a user's reader listed first (statistics gathered before the fault) the skip guard
gathers again: two a step, the same skip. Counted by `dist_scripts/collectives_per_step.py` at hf_stable's one
door (`hf_stable/distributed.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_scripts.harness import torchrun_two_ranks

SCRIPT = Path(__file__).parent / "dist_scripts" / "collectives_per_step.py"
STEPS, FAULT, LOGGING_STEPS = 9, 5, 4  # as in the script
GATHER = "grad_rows._gather"  # `core.grad_rows`: the rank-agreed rows of `GradStats`
AT_LOGGING_STEPS = {"memory_monitor.on_step_end", "throughput_monitor.on_step_end"}
ON_A_FAILING_STEP = ["non_finite_locator._read"]  # which tensors are non-finite on any rank (failing steps only)
# the chunked loss's own, not the guards': where each LM-head call gathers the head (ZeRO-3, FSDP2, whose recipe wrap
# makes lm_head a unit of its own), the ranks agree on the number of head calls - one all-reduce per micro-batch
LOSS_AGREEMENT = "head._max_over_ranks"


def _run(engine: str, out: Path) -> None:
    torchrun_two_ranks(SCRIPT, engine, str(out), timeout=300, env={"COLLECTIVES_TIMEOUT": "240"})


def check_arm(out: Path, per_step: int, loss_agreements: int = 0) -> None:
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0]["sites"] == ranks[1]["sites"]  # every collective entered by both ranks, at the same point
    for step in range(1, STEPS + 1):
        sites = ranks[0]["sites"][str(step)]
        assert sites.count(LOSS_AGREEMENT) == loss_agreements, (step, sites)  # one micro-batch a step
        every_step = [s for s in sites if s not in AT_LOGGING_STEPS and s != LOSS_AGREEMENT]
        expected = [GATHER] * per_step + (ON_A_FAILING_STEP if step == FAULT else [])
        assert sorted(every_step) == sorted(expected), (step, sites)
        interval = set(sites) - set(every_step) - {LOSS_AGREEMENT}
        assert interval == (AT_LOGGING_STEPS if step % LOGGING_STEPS == 0 else set()), (step, sites)
    for r in ranks:
        assert r["skipped"] == [FAULT] and r["finite"]  # the one-rank fault skipped on both ranks
    weights = [torch.load(out / f"rank{i}.pt") for i in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_ddp_adds_one_collective_per_step_and_a_one_rank_fault_is_skipped_on_both(tmp_path):
    _run("ddp", tmp_path)
    check_arm(tmp_path / "default", per_step=1)
    check_arm(tmp_path / "early_reader", per_step=2)  # gathered before the fault: gathered again at the guard
    # (at logging steps the monitor's max |g| rides on the second gather: no third)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(360)
@pytest.mark.parametrize("engine", [pytest.param("zero2", marks=pytest.mark.deepspeed), "fsdp2"])
def test_sharded_engines_add_one_collective_per_step(engine, tmp_path):
    # FSDP2: the one gather also gives the logged grad_norm, in place of the stock Trainer's own all-reduce
    _run(engine, tmp_path)
    agreements = int(engine == "fsdp2")
    check_arm(tmp_path / "default", per_step=1, loss_agreements=agreements)
    check_arm(tmp_path / "early_reader", per_step=2, loss_agreements=agreements)
