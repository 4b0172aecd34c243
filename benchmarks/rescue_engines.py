"""Rescue under sharded engines: the one-bad-rank and bad-data cases on 2 gloo ranks under DDP, DeepSpeed ZeRO-2 and
FSDP2, plain Trainer vs hf_stable (the recipe's defaults), each engine in one torchrun.

    OMP_NUM_THREADS=1 python benchmarks/rescue_engines.py [--engines ddp zero2 fsdp2] [--seeds 0] [--steps 100]

Cases (benchmarks/rescue_cases.py): `clean` (the reference), `nan` (loss NaN at 3 steps on rank 0), `spikes` (loss
x1e3 at 3 steps), `poison_burst` (10 consecutive garbage batches), `ddp_nan` (loss NaN at 3 steps on rank 1 only).
Verdicts as in rescue.py (ok = finite, ranks identical, within 5 % of the plain clean run under the same engine).
FSDP2 on CPU runs with the tests' switch (tests/dist_scripts/fsdp_cpu.py).

Last lines: `engine=E hf_stable_ok=N/M plain_ok=N/M` per engine.
"""

from __future__ import annotations

import argparse
import time

import rescue
import torch
from rescue_cases import CASES, pretrain_base
from rescue_report import judge

CASE_NAMES = ["clean", "nan", "spikes", "poison_burst", "ddp_clean", "ddp_nan"]
ARMS = ["plain", "hf_stable"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["ddp", "zero2", "fsdp2"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=100)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    rescue._quiet()
    t0 = time.perf_counter()
    rescue._STATE.update(steps=opts.steps, bases={"small": pretrain_base("small")})
    before = {"small": rescue._eval_before(rescue._STATE["bases"]["small"])}
    jobs = [(c, a, s) for s in opts.seeds for c in CASE_NAMES for a in ARMS if not (a == "hf_stable" and "clean" in c)]
    jobs += [(c, "hf_stable", s) for s in opts.seeds for c in ("clean", "ddp_clean")]
    lines = []
    for engine in opts.engines:
        started = time.perf_counter()
        results, _ = judge(rescue.run_ddp(jobs, opts.steps, timeout=3600, engine=engine), before)
        print(f"\n{engine} ({time.perf_counter() - started:.0f} s)")
        print("| case | seed | plain | hf_stable |")
        print("|---|---:|---|---|")
        by = {(r["case"], r["arm"], r["seed"]): r for r in results}
        for s in opts.seeds:
            for c in CASE_NAMES:
                cells = [by.get((c, a, s)) for a in ARMS]
                text = [f"{r['eval_loss']:.3f} {r['verdict']} ({r['skips']} skips)" if r else "-" for r in cells]
                print(f"| {c} | {s} | {' | '.join(text)} |")
        faulty = [r for r in results if not CASES[r["case"]].name.endswith("clean")]
        ok = {a: sum(r["verdict"] == "ok" for r in faulty if r["arm"] == a) for a in ARMS}
        n = sum(r["arm"] == "hf_stable" for r in faulty)
        lines.append(f"engine={engine} hf_stable_ok={ok['hf_stable']}/{n} plain_ok={ok['plain']}/{n}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
