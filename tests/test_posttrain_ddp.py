"""Two real DDP ranks on CPU (gloo) with `hf_stable.stabilize` on TRL's DPOTrainer and GRPOTrainer: a NaN on one
rank (in the forward, and in a gradient after the all-reduce; for GRPO also damaged importance ratios) is skipped on
both, and the ranks decide identically and a skipped DPO step names both ranks' pairs;
and DPO under DeepSpeed ZeRO-2 on 2 CPU ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_scripts.harness import torchrun_two_ranks

SCRIPT = Path(__file__).parent / "dist_scripts" / "posttrain_ddp.py"


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_dpo_and_grpo_on_two_ranks_decide_identically(tmp_path):
    pytest.importorskip("trl")
    torchrun_two_ranks(SCRIPT, str(tmp_path), timeout=300, env={"POSTTRAIN_DDP_TIMEOUT": "280"})
    for kind in ("dpo", "grpo"):
        ranks = [json.loads((tmp_path / kind / f"rank{i}.json").read_text()) for i in (0, 1)]
        for r in ranks:
            assert r["world_size"] == 2
            bad = [3, 5, 6] if kind == "grpo" else [3, 5]  # GRPO step 6: damaged importance ratios on rank 1 only
            assert r["engine"] == "ddp" and r["skipped"] == bad and r["finite"], (kind, r)
            assert set(bad) <= set(r["unchanged_at"]), (kind, r)  # (a zero-signal GRPO step may leave them too)
        assert ranks[0]["events"] == ranks[1]["events"], kind
        if kind == "dpo":  # each skipped step names its 8 pairs (4 a rank, gathered), the same list on both ranks
            assert ranks[0]["pairs"] == ranks[1]["pairs"] and set(ranks[0]["pairs"]) == {"3", "5"}, ranks
            assert all(len(set(ids)) == 8 and set(ids) <= set(range(32)) for ids in ranks[0]["pairs"].values())
        w0, w1 = (torch.load(tmp_path / kind / f"rank{i}.pt") for i in (0, 1))
        assert set(w0) == set(w1) and all(torch.equal(w0[k], w1[k]) for k in w0), kind


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(330)
def test_dpo_under_zero2_skips_a_one_rank_nan_on_both(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    env = {"POSTTRAIN_DDP_TIMEOUT": "280", "POSTTRAIN_DDP_ENGINE": "zero2", "POSTTRAIN_DDP_KINDS": "dpo"}
    torchrun_two_ranks(SCRIPT, str(tmp_path), timeout=300, env=env)
    ranks = [json.loads((tmp_path / "dpo" / f"rank{i}.json").read_text()) for i in (0, 1)]
    for r in ranks:  # StableDPOTrainer runs the guards between DeepSpeed's backward and its step
        assert r["engine"] == "deepspeed_zero2" and r["skipped"] == [3] and r["finite"], r
        assert r["unchanged_at"] == [3], r
    assert ranks[0]["events"] == ranks[1]["events"]
    w0, w1 = (torch.load(tmp_path / "dpo" / f"rank{i}.pt") for i in (0, 1))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
