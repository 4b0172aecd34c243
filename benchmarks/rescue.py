"""Rescue benchmark: seeded failure cases x stability mechanisms (the plain Trainer, hf_stable, and the peers').

    OMP_NUM_THREADS=1 python benchmarks/rescue.py [--seeds 0,1,2] [--cases ...] [--arms ...] [--steps 100]
                                                  [--quick] [--jobs 2] [--events-table] [--json PATH]
                                                  [--tree DIR --label before]
    python benchmarks/rescue.py --compare BEFORE.json AFTER.json    # markdown before/after table, runs nothing

What runs (details in the modules next to this one):

* `rescue_cases.py`   the task (Markov languages), the tiny bases (4-layer hidden 64; 8-layer; hidden 128) and the
  cases: LR 10x / 30x sustained, no warmup, attention-logit growth, emulated fp16 overflow, bf16 autocast, NaN and
  spiked losses, garbage batches and a garbage burst, mislabeled records, an extreme-length sample, one bad DDP
  rank (NaN / spike), and the clean runs that are the references.
* `rescue_harness.py` one run: same base, data, seed, LR schedule and steps for every arm; the arms: `plain`,
  `hf_stable` (the recipe's defaults) and its opt-ins (`hf_snr`, `hf_qkclip`, `hf_phases`, on their cases).
* `peers.py`          the peers, each from its published rule (cited there): OLMo-core skip-step, torchtitan /
  Megatron non-finite stop, ZClip, SPAM, Axolotl's loss watchdog.
* `rescue_report.py`  verdicts (ok = finite and within 5 % of the plain clean run; a stop is a failure), the
  table, one `arm=... ok=N/M` line per arm and the last line.
* `rescue_ddp.py`     the DDP cases on 2 gloo ranks (one torchrun for all of them).
* `rescue_said.py`    what the runs said: the events table (`--events-table`), the results file (`--json`) and the
  before/after table (`--compare`). `--tree DIR` runs the same benchmark against another checkout's `hf_stable`
  package (`git archive REV hf_stable | tar -x -C DIR`): the cases, arms and verdict rule stay this checkout's.

Single-process runs go to `--jobs` worker processes (forked after the bases are pretrained, one torch thread each);
the DDP runs follow, alone. `cpu_x` is the arm's process CPU time over plain's on the same case and seed (with one
thread per process that is its compute time; wall time on a shared machine is not comparable).

Last line (machine-readable): `hf_stable_ok=N/M best_peer_ok=N/M hf_stable_not_worse_than_best_peer=K/M`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_STABLE_LOG_LEVEL", "CRITICAL")  # events are counted in the table instead


def _tree(argv: list[str]) -> str | None:
    """`--tree DIR` read before anything imports hf_stable (DIR holds the `hf_stable` package to benchmark)."""
    for i, arg in enumerate(argv):
        if arg == "--tree" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--tree="):
            return arg.split("=", 1)[1]
    return None


TREE = _tree(sys.argv[1:])
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(TREE).resolve() if TREE else Path(__file__).resolve().parents[1]))

import torch
from rescue_cases import CASES, fp16_scale, pretrain_base
from rescue_harness import ARMS, OPT_IN, run_one
from rescue_report import REFERENCE_ONLY, judge, summary, table
from rescue_said import compare, events_table, read_json, write_json

QUICK = {"seeds": [0], "cases": ["clean", "lr_10x", "nan", "poison_burst", "attn_logits", "ddp_nan"]}
_STATE: dict = {}  # the pretrained bases etc., inherited by forked workers


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    logging.getLogger("hf_stable").setLevel(logging.CRITICAL)


def _ints(values: list[str]) -> list[int]:
    return [int(v) for item in values for v in item.split(",") if v]


def _names(parser, values: list[str], allowed, what: str) -> list[str]:
    names = [v for item in values for v in item.split(",") if v]
    bad = [n for n in names if n not in allowed]
    if bad:
        parser.error(f"--{what}: unknown {', '.join(bad)} (allowed: {', '.join(allowed)})")  # exit code 2
    return names


def plan(cases: list[str], arms: list[str], seeds: list[int]) -> list[tuple[str, str, int]]:
    """(case, arm, seed) to run: plain (the baseline) and the asked arms on each case - opt-ins only on their cases,
    reference-only cases only plain and the opt-ins made for them - plus plain on each reference nobody asked for."""
    refs = [CASES[c].clean for c in cases if CASES[c].clean not in cases]
    arms = ["plain", *(a for a in arms if a != "plain")]
    runs = []
    for case in list(dict.fromkeys(cases + refs)):
        for arm in arms if case not in refs else ["plain"]:
            if arm in OPT_IN and case not in OPT_IN[arm]:
                continue
            if case in REFERENCE_ONLY and arm != "plain" and arm not in OPT_IN:
                continue
            runs += [(case, arm, seed) for seed in seeds]
    return runs


def _eval_before(base) -> float:
    from rescue_cases import eval_rows
    from rescue_harness import training_args
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(model=copy.deepcopy(base), args=training_args(tmp), eval_dataset=eval_rows())
        return trainer.evaluate()["eval_loss"]


def _worker(job: tuple[str, str, int]) -> dict:
    case, arm, seed = job
    torch.set_num_threads(1)
    base = CASES[case].base
    return run_one(_STATE["bases"][base], CASES[case], arm, seed, _STATE["steps"], fp16_scale=_STATE["fp16_scale"])


def run_local(jobs: list[tuple[str, str, int]], n_jobs: int) -> list[dict]:
    # Longest first (deep base, hf_stable arms) so the workers finish together.
    weight = {"deep": 2.0, "wide": 1.3, "small": 1.0}
    jobs = sorted(jobs, key=lambda j: -(weight[CASES[j[0]].base] * (1.2 if j[1].startswith("hf_") else 1.0)))
    results = []
    if n_jobs <= 1:
        for job in jobs:
            results.append(_worker(job))
            _progress(results[-1])
        return results
    with ProcessPoolExecutor(n_jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for result in pool.map(_worker, jobs):
            results.append(result)
            _progress(result)
    return results


def run_ddp(jobs: list[tuple[str, str, int]], steps: int, timeout: int = 1800, engine: str = "ddp") -> list[dict]:
    torchrun = Path(sys.executable).parent / "torchrun"
    with tempfile.TemporaryDirectory() as tmp:
        base_dir, out = Path(tmp, "base"), Path(tmp, "out.jsonl")
        _STATE["bases"]["small"].save_pretrained(base_dir)
        spec = {"base_dir": str(base_dir), "steps": steps, "runs": jobs, "out": str(out), "timeout": timeout - 30}
        spec["engine"] = engine
        Path(tmp, "spec.json").write_text(json.dumps(spec))
        cmd = [
            str(torchrun),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            str(Path(__file__).with_name("rescue_ddp.py")),
            str(Path(tmp, "spec.json")),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path[:2])}
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True, check=False)
        results = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        if proc.returncode != 0 or len(results) != len(jobs):
            print(
                f"DDP runs failed (exit {proc.returncode}, {len(results)}/{len(jobs)} results):\n"
                f"{proc.stderr[-3000:]}",
                file=sys.stderr,
            )
    for r in results:
        _progress(r)
    return results


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress(r: dict) -> None:
    stop = f" stopped@{r['stopped']}" if r.get("stopped") else ""
    print(
        f"  {r['case']:<12} {r['arm']:<16} seed {r['seed']}: eval {r['eval_loss']:.3f} skips {r['skips']} "
        f"rollbacks {r['rollbacks']}{stop} ({r['cpu_s']:.1f}s cpu)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs="+", default=["0,1,2"], help="0,1,2 or 0 1 2")
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--arms", nargs="+", default=list(ARMS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help=f"seeds {QUICK['seeds']}, cases {QUICK['cases']}")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for the single-process runs")
    parser.add_argument("--events-table", action="store_true", help="per case x arm x seed: events, verdict")
    parser.add_argument("--json", metavar="PATH", help="write every result (and how it was made) to PATH")
    parser.add_argument("--tree", metavar="DIR", help="benchmark the hf_stable package under DIR instead")
    parser.add_argument("--label", default=None, help="name of this arm in --json (default: after, or before)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two --json files: markdown table")
    opts = parser.parse_args(argv)
    if opts.compare:
        print("\n".join(compare(read_json(opts.compare[0]), read_json(opts.compare[1]))))
        return
    seeds = QUICK["seeds"] if opts.quick else _ints(opts.seeds)
    cases = QUICK["cases"] if opts.quick else _names(parser, opts.cases, CASES, "cases")
    arms = _names(parser, opts.arms, ARMS, "arms")
    torch.set_num_threads(1)
    _quiet()
    import hf_stable

    package = str(Path(hf_stable.__file__).resolve().parent)
    print(f"hf_stable from {package}", flush=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    runs = plan(cases, arms, seeds)
    bases = sorted(
        {CASES[c].base for c, _, _ in runs} | ({"small"} if any(CASES[c].ddp for c, _, _ in runs) else set())
    )
    _STATE.update(steps=opts.steps, bases={}, before={})
    for name in bases:
        _STATE["bases"][name] = pretrain_base(name)
        _STATE["before"][name] = _eval_before(_STATE["bases"][name])
    _STATE["fp16_scale"] = fp16_scale(_STATE["bases"]["small"]) if "small" in bases else 1.0
    before = ", ".join(f"{k} {v:.3f}" for k, v in _STATE["before"].items())
    print(
        f"bases pretrained ({time.process_time() - cpu0:.0f}s cpu); eval loss before fine-tuning: {before}; "
        f"emulated fp16 overflows at |y| > {65504 / _STATE['fp16_scale']:.2f}; "
        f"{len(runs)} runs x {opts.steps} steps",
        flush=True,
    )
    local = [r for r in runs if not CASES[r[0]].ddp]
    ddp = [r for r in runs if CASES[r[0]].ddp]
    results = run_local(local, opts.jobs) + (run_ddp(ddp, opts.steps) if ddp else [])
    results, noise = judge(results, _STATE["before"])
    print()
    print("\n".join(table(results)))
    refs = sorted({(CASES[r["case"]].clean, r["seed"]) for r in results})
    plain = {(r["case"], r["seed"]): r["eval_loss"] for r in results if r["arm"] == "plain"}
    print(
        "reference (plain clean eval loss): "
        + ", ".join(f"{c}/seed{s} {plain.get((c, s), float('nan')):.3f}" for c, s in refs)
    )
    cpu_total = sum(r["cpu_s"] for r in results)
    print(
        f"total {time.perf_counter() - t0:.0f}s wall; run CPU time {cpu_total:.0f}s (+{time.process_time() - cpu0:.0f}s "
        f"in this process); DDP runs count rank 0 only"
    )
    print("\n".join(summary(results, noise)))
    if opts.events_table:
        print()
        print("\n".join(events_table(results)))
    if opts.json:
        label = opts.label or ("before" if opts.tree else "after")
        meta = {"label": label, "hf_stable": package, "seeds": seeds, "cases": cases, "arms": arms}
        write_json(opts.json, results, {**meta, "steps": opts.steps, "noise": noise})
        print(f"results written to {opts.json}")


if __name__ == "__main__":
    main()
