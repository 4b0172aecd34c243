"""Overhead of hf_stable's monitors + guards under each engine, and the collectives they add per step.

    OMP_NUM_THREADS=1 python benchmarks/engine_overhead.py [--engines ddp zero2 fsdp2] [--rounds 4] [--steps 40]
                                                       [--hidden 256] [--layers 4]

Starts itself on 2 gloo ranks (torchrun). Per engine, arms alternate inside the one run: `off` (StableTrainer, no
callbacks) and `on` (StableTrainer + the recipe's default monitors and guards), `--rounds` times each, on a small
LoRA Llama (`--hidden`, `--layers`; batch 4 x 64 tokens per rank). Time: the train loop after 5 warm-up steps (rank 0's wall clock; both ranks
share the 2 cores). Collectives: every `torch.distributed` collective entered, counted on rank 0 over the timed
steps; the per-step difference between the arms is what hf_stable adds (the engine's own are in both arms).

Last lines: `engine=E overhead=R collectives_added_per_step=C`.
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

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == WARMUP:
                self.start, counter["n"], counter["on"] = time.perf_counter(), 0, True

        def on_train_end(self, args, state, control, **kwargs):
            counter["on"] = False
            self.seconds, self.collectives = time.perf_counter() - self.start, counter["n"]

    lines = []
    for engine in engines:
        times: dict[str, list[float]] = {"off": [], "on": []}
        calls: dict[str, list[int]] = {"off": [], "on": []}
        for _ in range(rounds):
            for arm in ("off", "on"):
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
        timed = steps - WARMUP
        ratio = statistics.median(times["on"]) / statistics.median(times["off"])
        added = (statistics.median(calls["on"]) - statistics.median(calls["off"])) / timed
        if rank == 0:
            print(
                f"{engine}: off {statistics.median(times['off']) / timed * 1e3:.1f} ms/step, "
                f"on {statistics.median(times['on']) / timed * 1e3:.1f} ms/step; collectives per step "
                f"off {statistics.median(calls['off']) / timed:.2f}, on {statistics.median(calls['on']) / timed:.2f}",
                flush=True,
            )
        lines.append(f"engine={engine} overhead={ratio:.3f} collectives_added_per_step={added:.2f}")
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
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
