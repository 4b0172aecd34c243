"""Two real DDP ranks on CPU (gloo): a NaN on one rank only makes both ranks skip, weights stay identical, no hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "dist_scripts" / "guards_ddp.py"


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_nan_on_one_rank_skips_on_both_and_weights_stay_identical(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "GUARDS_DDP_TIMEOUT": "150"}
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(SCRIPT), str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"2-rank guard run timed out (a rank hung in a collective?):\n{stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0]["world_size"] == 2
    for r in ranks:
        assert r["skipped"] == [3, 6]  # step 6: only rank 1 saw the NaN, the agreed flag skipped it on rank 0 too
        assert r["unchanged_at"] == [3, 6]
        assert r["finite"]
    assert [e["kind"] for e in ranks[0]["events"]] == [e["kind"] for e in ranks[1]["events"]]
    w0, w1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert set(w0) == set(w1) and all(torch.equal(w0[k], w1[k]) for k in w0)
