"""Two real DDP ranks on CPU (gloo) log identical monitor metrics and name the same poisoned parameter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.dist_scripts.harness import torchrun_two_ranks

SCRIPT = Path(__file__).parent / "dist_scripts" / "monitor_ddp.py"


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_log_identical_metrics(tmp_path):
    # the script's faulthandler ends a hung rank after MONITOR_DDP_TIMEOUT s with stack traces
    torchrun_two_ranks(SCRIPT, str(tmp_path), timeout=260, env={"MONITOR_DDP_TIMEOUT": "200"})
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0]["world_size"] == 2
    h0, h1 = ranks[0]["history"], ranks[1]["history"]
    assert len(h0) == len(h1) == 5
    for row0, row1 in zip(h0, h1, strict=False):
        assert row0.keys() == row1.keys()
        differing = {k: (row0[k], row1[k]) for k in row0 if not _same(row0[k], row1[k])}
        assert not differing, differing
    keys = set().union(*h0)
    assert {
        "grad/norm_global",
        "grad/norm/layer_0",
        "loss/train",
        "update/ratio/layer_0",
        "mem/rss_gib",
        "perf/tokens_per_s",
    } <= keys
    assert h0[0]["loss/train"] == pytest.approx(h0[0]["loss"], rel=1e-5)  # the all-reduced loss is the Trainer's
    # only rank 1 poisoned the gradient; after all-reduce both ranks name the same parameter at the same step
    located = [[e for e in r["events"] if e["kind"] == "nonfinite_grad"] for r in ranks]
    assert located[0] and located[0][0] == located[1][0]
    assert located[0][0]["step"] == 3 and located[0][0]["params"] == ["model.layers.1.mlp.down_proj.weight"]
    assert [e["kind"] for e in ranks[0]["events"]] == [e["kind"] for e in ranks[1]["events"]]
