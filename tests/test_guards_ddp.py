"""Two real DDP ranks on CPU (gloo): a NaN on one rank only makes both ranks skip, weights stay identical, no hang;
with the stock Trainer and with `StableTrainer`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_scripts.harness import torchrun_two_ranks

SCRIPT = Path(__file__).parent / "dist_scripts" / "guards_ddp.py"


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_nan_on_one_rank_skips_on_both_and_weights_stay_identical(tmp_path):
    torchrun_two_ranks(SCRIPT, str(tmp_path), timeout=200, env={"GUARDS_DDP_TIMEOUT": "150"})
    for out in (tmp_path, tmp_path / "stable"):  # stock Trainer, then StableTrainer (a monitor listed first)
        check_ranks(out)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_nan_on_one_rank_at_batch_1_is_still_skipped_on_both(tmp_path):
    # one record per rank and step (the noisiest steps there are): the noise-calibrated rules leave the clean steps
    # alone and the non-finite ones are skipped on both ranks all the same
    env = {"GUARDS_DDP_TIMEOUT": "150", "GUARDS_DDP_BATCH": "1", "GUARDS_DDP_TRAINERS": "stable"}
    torchrun_two_ranks(SCRIPT, str(tmp_path), timeout=200, env=env)
    check_ranks(tmp_path / "stable")


def check_ranks(tmp_path):
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0]["world_size"] == 2
    for r in ranks:
        assert r["skipped"] == [3, 6, 8]  # step 6: only rank 1 saw the NaN, the agreed flag skipped it on rank 0 too
        assert r["unchanged_at"] == [3, 6]  # step 8 was skipped and rolled back: weights of step 0 again
        assert r["restored_to_start"] and r["finite"]
        rollbacks = [e for e in r["events"] if e["kind"].startswith("rollback")]
        assert [(e["kind"], e["step"], e["check"]) for e in rollbacks] == [("rollback", 8, "damaged weights")]
    assert [e["kind"] for e in ranks[0]["events"]] == [e["kind"] for e in ranks[1]["events"]]
    w0, w1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert set(w0) == set(w1) and all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_repeat_rollback_for_non_finite_steps_is_declined_on_both_ranks(tmp_path):
    # rank 1 alone overflows at 5-7 and 15-17: both roll back at 7, both decline the repeat at 17 (the
    # weights-finite flag is a collective entered by both), and the ranks end bitwise identical
    script = Path(__file__).parent / "dist_scripts" / "repeat_nonfinite_ddp.py"
    torchrun_two_ranks(script, str(tmp_path), timeout=200, env={"GUARDS_DDP_TIMEOUT": "150"})
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    for r in ranks:
        assert r["skipped"] == [5, 6, 7, 15, 16, 17]
        kinds = [(e["kind"], e["step"]) for e in r["events"] if e["kind"].startswith("rollback")]
        assert kinds == [("rollback", 7), ("rollback_declined", 17)]
        assert r["rollbacks"] == 1 and r["lr_factor"] == pytest.approx(0.5) and r["finite"]
    assert ranks[0]["events"] == ranks[1]["events"]
    w0, w1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert set(w0) == set(w1) and all(torch.equal(w0[k], w1[k]) for k in w0)
