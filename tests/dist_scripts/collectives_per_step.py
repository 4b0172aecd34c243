"""Two-rank run (gloo, CPU) of `StableTrainer` with the recipe's default monitors and guards under one engine,
counting the collectives hf_stable enters in each optimizer step; each rank writes OUT/<arm>/rank<i>.json.

Launched by tests/test_collectives_per_step.py as `torchrun --nproc_per_node 2 collectives_per_step.py ENGINE OUT`.
Every `torch.distributed` collective called from `hf_stable/distributed.py` (the one door of hf_stable's
collectives) is counted against the step it falls in (from one `on_step_begin` to the next) with the hf_stable
function that asked for it. A fault on rank 1 only: at step `FAULT` one element of rank 1's part of a gradient
becomes NaN *after* the gradients were reduced (a callback between the monitors and the guards, `LocalGradFault`).
Two arms in one process group:

* `default`: the monitors, the fault, the guards - the monitors' reads wait for the skip guard's gather.
* `early_reader`: a user callback listed first reads the statistics itself (gathering them before the fault), so
  the skip guard must max-reduce its flags: one more collective a step, and still the same skip.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import fsdp_cpu  # launched by torchrun only: the script's own directory is on sys.path
import torch
import torch.distributed as dist
from engines import engine_args, full_weights
from guards_common import all_finite, tiny_lora_llama, token_data, training_args
from transformers import TrainerCallback

from hf_stable.callbacks.guards import SkipGuard, build_guards
from hf_stable.callbacks.monitors import build_monitors
from hf_stable.config.run import RunConfig
from hf_stable.core.engine import StepEngine
from hf_stable.core.grad_stats import GradStats
from hf_stable.distributed import shutdown
from hf_stable.trainer import StableTrainer

STEPS = 9
FAULT = 5
LOGGING_STEPS = 4
COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast", "barrier")
DOOR = os.path.join("hf_stable", "distributed.py")
HELPERS = ("distributed.py", "monitor_utils.py", "rank_agreement.py")


class Counter:
    """Counts hf_stable's collectives per optimizer step (1-based, the step being made)."""

    def __init__(self):
        self.step: int | None = None
        self.sites: dict[int, list[str]] = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn))

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            caller = sys._getframe(1)
            if self.step is not None and caller.f_code.co_filename.endswith(DOOR):
                frame = caller
                while frame is not None and frame.f_code.co_filename.endswith(HELPERS):
                    frame = frame.f_back
                site = "?" if frame is None else f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"
                self.sites.setdefault(self.step, []).append(site)
            return fn(*args, **kwargs)

        return counted


class StepClock(TrainerCallback):
    """Listed first: moves the counter to the step being made."""

    def __init__(self, counter: Counter):
        self.counter = counter

    def on_step_begin(self, args, state, control, **kwargs):
        self.counter.step = state.global_step + 1

    def on_train_end(self, args, state, control, **kwargs):
        self.counter.step = None


class LocalGradFault(TrainerCallback):
    """NaN into one element of this rank's part of the first gradient it holds (`p.grad`, a ZeRO fragment, an FSDP2
    shard), at optimizer step `step` on rank `rank` only."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step and args.process_index == self.rank:
            params = [p for p in model.parameters() if p.requires_grad]
            grad = next(g for g in StepEngine.of(model).local_grads(params) if g is not None and g.numel())
            grad.view(-1)[0] = float("nan")


class EarlyReader(TrainerCallback):
    """A user's callback that reads the step's statistics before hf_stable's callbacks (a collective of its own)."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        GradStats.shared(model).compute(model, step=state.global_step)


def run(engine: str, out: Path, counter: Counter, early_reader: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    counter.sites = {}
    model = tiny_lora_llama()
    cfg = RunConfig()
    monitors, guards = build_monitors(cfg.stability.monitors), build_guards(cfg.stability.guards)
    first = [EarlyReader()] if early_reader else []
    callbacks = [StepClock(counter), *first, *monitors, LocalGradFault(step=FAULT, rank=1), *guards]
    args = training_args(
        out, max_steps=STEPS, per_device_train_batch_size=2, logging_steps=LOGGING_STEPS, **engine_args(engine)
    )
    trainer = StableTrainer(model=model, args=args, train_dataset=token_data(64), callbacks=callbacks)
    trainer.train()
    weights = full_weights(model)  # a collective under FSDP2: after the counted steps
    skip = next(g for g in guards if isinstance(g, SkipGuard))
    result = {
        "sites": {str(s): sites for s, sites in counter.sites.items()},
        "skipped": skip.skipped_steps,
        "finite": all_finite({str(i): w for i, w in enumerate(weights)}),
    }
    torch.save(weights, out / f"rank{args.process_index}.pt")
    (out / f"rank{args.process_index}.json").write_text(json.dumps(result))


def main(engine: str, out: str) -> None:
    faulthandler.dump_traceback_later(int(os.environ.get("COLLECTIVES_TIMEOUT", "240")), exit=True)
    if engine == "fsdp2":
        fsdp_cpu.enable()
    counter = Counter()
    run(engine, Path(out, "default"), counter, early_reader=False)
    run(engine, Path(out, "early_reader"), counter, early_reader=True)
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results are on disk; skip gloo's teardown at interpreter exit (see guards_ddp.py)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
