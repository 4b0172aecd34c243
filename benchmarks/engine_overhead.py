"""Overhead of hf_stable's monitors + guards under each engine, and the collectives they add per step.

    OMP_NUM_THREADS=1 python benchmarks/engine_overhead.py [--engines ddp zero2 fsdp2] [--rounds 4] [--steps 40]
                                                       [--hidden 256] [--layers 4]

Starts itself on 2 gloo ranks (one torchrun per engine). Per engine, arms alternate inside the one run: `off`
(StableTrainer, no callbacks) and `on` (StableTrainer + the recipe's default monitors and guards), `--rounds` times
each, each arm first in every other round, on a small LoRA Llama (`--hidden`, `--layers`; batch 4 x 64 tokens per
rank), each rank pinned to a core of its own when there are enough. Time: the train loop after 5 warm-up steps, rank
0's wall clock. `overhead` is the median over rounds of each round's own on / off ratio, with its min and max: on a
2-core machine a run's time scatters by several percent, so take 6 or more rounds.

Collectives: every `torch.distributed` collective entered, counted on rank 0 per timed step (from one
`on_step_begin` to the next); the engine's own are in both arms. What hf_stable adds is split in two: the
collectives every step pays (the fewest any timed step entered, on minus off) and those of checks that run at an
interval (logging steps, the replica check, the update monitor: the rest of the mean, per step).

Last lines: `engine=E overhead=R overhead_min=m overhead_max=M collectives_added_per_step=C
interval_collectives_per_step=I`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "broadcast",
    "all_gather_object",
    "barrier",
    "reduce_scatter",
    "all_to_all_single",
)
WARMUP = 5


def _count_collectives() -> dict:
    import torch.distributed as dist

    counter = {"n": 0, "on": False}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*args, _fn=fn, **kwargs):
            if counter["on"]:
                counter["n"] += 1
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)
    return counter


def _worker(engines: list[str], rounds: int, steps: int, hidden: int, layers: int) -> None:
    sys.path[:0] = [str(ROOT / "tests" / "dist_scripts"), str(ROOT)]
    import fsdp_cpu
    import torch
    from engines import engine_args
    from guards_common import tiny_lora_llama, token_data, training_args
    from transformers import TrainerCallback

    from hf_stable.callbacks.guards import build_guards
    from hf_stable.callbacks.monitors import build_monitors
    from hf_stable.config.run import RunConfig
    from hf_stable.distributed import shutdown
    from hf_stable.trainer import StableTrainer

    fsdp_cpu.enable()
    counter = _count_collectives()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= int(os.environ["WORLD_SIZE"]):  # a core of its own per rank: less scatter from the scheduler
        os.sched_setaffinity(0, {cores[rank]})

    class Clock(TrainerCallback):
        def __init__(self):
            self.per_step: list[int] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if counter["on"]:
                self.per_step.append(counter["n"])
            if state.global_step == WARMUP:
                self.start, counter["on"] = time.perf_counter(), True
            counter["n"] = 0

        def on_train_end(self, args, state, control, **kwargs):
            counter["on"] = False
            self.per_step.append(counter["n"])
            self.seconds, self.collectives = time.perf_counter() - self.start, sum(self.per_step)

    lines = []
    for engine in engines:
        times: dict[str, list[float]] = {"off": [], "on": []}
        calls: dict[str, list[int]] = {"off": [], "on": []}
        fewest: dict[str, list[int]] = {"off": [], "on": []}  # the collectives every timed step entered
        for k in range(rounds):
            for arm in ("off", "on") if k % 2 == 0 else ("on", "off"):  # each arm first in every other round
                cfg = RunConfig()
                callbacks = [*build_monitors(cfg.stability.monitors), *build_guards(cfg.stability.guards)]
                clock = Clock()
                out = f"/tmp/hf_stable_engine_overhead_{engine}"
                args = training_args(
                    out, max_steps=steps, per_device_train_batch_size=4, logging_steps=10, **engine_args(engine)
                )
                trainer = StableTrainer(
                    model=tiny_lora_llama(hidden=hidden, layers=layers),
                    args=args,
                    train_dataset=token_data(steps * 8, length=64),
                    callbacks=[*(callbacks if arm == "on" else []), clock],
                )
                trainer.train()
                times[arm].append(clock.seconds)
                calls[arm].append(clock.collectives)
                fewest[arm].append(min(clock.per_step))
        timed = steps - WARMUP
        paired = [on / off for on, off in zip(times["on"], times["off"], strict=True)]  # each round: on against off
        ratio = statistics.median(paired)
        added = (statistics.median(calls["on"]) - statistics.median(calls["off"])) / timed
        every_step = statistics.median(fewest["on"]) - statistics.median(fewest["off"])
        interval = added - every_step
        if rank == 0:
            print(
                f"{engine}: off {statistics.median(times['off']) / timed * 1e3:.1f} ms/step, "
                f"on {statistics.median(times['on']) / timed * 1e3:.1f} ms/step; collectives per step "
                f"off {statistics.median(calls['off']) / timed:.2f}, on {statistics.median(calls['on']) / timed:.2f}; "
                f"paired per-round ratios {' '.join(f'{r:.3f}' for r in paired)}",
                flush=True,
            )
        lines.append(
            f"engine={engine} overhead={ratio:.3f} overhead_min={min(paired):.3f} overhead_max={max(paired):.3f} "
            f"collectives_added_per_step={every_step:.2f} "
            f"interval_collectives_per_step={interval:.2f}"
        )
    if rank == 0:
        print("\n".join(lines), flush=True)
    shutdown()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["ddp", "zero2", "fsdp2"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    opts = parser.parse_args()
    if "RANK" in os.environ:
        _worker(opts.engines, opts.rounds, opts.steps, opts.hidden, opts.layers)
        return
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_STABLE_LOG_LEVEL": "CRITICAL", "TOKENIZERS_PARALLELISM": "false"}
    rest = ["--rounds", str(opts.rounds), "--steps", str(opts.steps), "--hidden", str(opts.hidden)]
    rest += ["--layers", str(opts.layers)]
    lines, status = [], 0
    for engine in opts.engines:  # one torchrun per engine: accelerate's state is per process
        cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", __file__, "--engines", engine, *rest]
        proc = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
        out = [line for line in proc.stdout.splitlines() if line.startswith((f"{engine}:", "engine="))]
        print("\n".join(line for line in out if not line.startswith("engine=")) or proc.stderr[-2000:], flush=True)
        lines += [line for line in out if line.startswith("engine=")]
        status = status or proc.returncode
    print("\n".join(lines))
    sys.exit(status)


if __name__ == "__main__":
    main()
