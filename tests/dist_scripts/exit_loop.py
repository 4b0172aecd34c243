"""Runs the 2-rank recipe many times and counts exit codes: a finished run must exit 0 every time.

    nice -n 10 .venv/bin/python tests/dist_scripts/exit_loop.py --runs 50

Not part of the test suite (minutes of CPU). Each run is `torchrun --standalone --nproc_per_node 2
scripts/finetune.py --training.use_cpu true ...` with the tiny settings of tests/test_distributed.py (6 steps,
96 rows); `--preempt` makes rank 1 receive SIGTERM at step 2 (through tests/dist_scripts/recipe_probe.py): both
ranks must then exit 143 through the recipe's preemption path, as each rank records (torchrun itself exits 1 when a
worker exits non-zero, and SIGTERMs the ranks still running). A run that ends otherwise is printed with the tail of
its output.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import ROOT, TORCHRUN, recipe_args, session_dir

RECIPE = ROOT / "scripts" / "finetune.py"
PROBE = Path(__file__).resolve().parent / "recipe_probe.py"


def rank_codes(probe: Path) -> dict[int, int]:
    """Each rank's own exit status, as recipe_probe.py records it."""
    codes = (json.loads(f.read_text()) for f in probe.glob("exit_rank*.json"))
    return {c["rank"]: c["code"] for c in codes}


def run_once(out: Path, preempt: bool, timeout: int) -> tuple[int, str, float]:
    args = recipe_args(out, steps=6, n_train=96) + ["--training.use_cpu", "true"]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }
    script = RECIPE
    if preempt:  # the probe launcher runs finetune.py unchanged and sends rank 1 SIGTERM at the end of step 2
        script = PROBE
        env.update(HF_STABLE_FAULT="sigterm:2:1", HF_STABLE_PROBE_DIR=str(out.parent / "probe"))
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(script), *args]
    start = time.time()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return -999, output, time.time() - start
    return proc.returncode, output, time.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run before it counts as a hang")
    parser.add_argument("--preempt", action="store_true", help="SIGTERM rank 1 at step 2 (expect exit 143)")
    opts = parser.parse_args()
    expected = 143 if opts.preempt else 0
    codes: collections.Counter = collections.Counter()
    for i in range(opts.runs):
        work = session_dir() / f"run{i}"
        code, output, seconds = run_once(work / "out", opts.preempt, opts.timeout)
        if opts.preempt:
            per_rank = rank_codes(work / "probe")
            code = 143 if per_rank == {0: 143, 1: 143} else (code or 1)
        codes[code] += 1
        ok = code == expected and "terminate called" not in output and "SIGABRT" not in output
        print(f"run {i + 1}/{opts.runs}: exit {code} in {seconds:.0f}s{'' if ok else '  <-- FAILED'}", flush=True)
        if not ok:
            print(output[-4000:], flush=True)
        shutil.rmtree(work, ignore_errors=True)
    good = codes[expected]
    print(
        f"\n{good}/{opts.runs} runs exited {expected}{' on both ranks' if opts.preempt else ''}; "
        f"exit codes: {dict(codes)}"
    )
    sys.exit(0 if good == opts.runs else 1)


if __name__ == "__main__":
    main()
