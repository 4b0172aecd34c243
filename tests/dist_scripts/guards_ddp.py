"""Two-rank DDP run (gloo, CPU) with the default guards; each rank writes OUT/rank<i>.json and its final trainable
weights to OUT/rank<i>.pt.

Launched by tests/test_guards_ddp.py as `torchrun --nproc_per_node 2 guards_ddp.py OUT`. Two faults, both on
rank 1 only:

* step 3: the loss is NaN on rank 1 (forward hook); DDP's all-reduce spreads NaN to both ranks' gradients.
* step 6: one gradient element is set to NaN on rank 1 *after* the all-reduce; rank 0's gradients are clean, so
  only the guard's agreed decision (a max-reduced flag) keeps rank 0 from stepping while rank 1 skips.
* after step 7: rank 1's weights are damaged (NaN), so step 8 is bad on both ranks - the third bad step within 20.
  The rollback check re-runs the batch on each rank at the current and the snapshot's weights; its all-reduced
  numbers (NaN now, finite at the snapshot) say "damaged" on both, and both restore the snapshot of step 0.

`GUARDS_DDP_BATCH=1` (records per rank and step) with `GUARDS_DDP_TRAINERS=stable` runs the `StableTrainer` pass
alone at batch 1. Both ranks must skip steps 3, 6 and 8, roll back at 8, end with bitwise identical finite weights, and never hang
(the faulthandler below turns a hang into stack traces and an exit). The same run follows with `StableTrainer` in
the same process group (results in OUT/stable/), a gradient monitor listed first: its read waits for the skip
guard's gather (`core.step_readers`), which comes after the step-6 edit, so both ranks judge rank 1's NaN from the
same numbers - without entering a collective the other rank does not enter (a reader that gathers before the edit:
tests/test_collectives_per_step.py).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from guards_common import (
    GradFaultOnRank,
    LossFault,
    Recorder,
    WeightDamage,
    all_finite,
    tiny_lora_llama,
    token_data,
    training_args,
    weights_equal,
)
from transformers import Trainer

from hf_stable.callbacks import GradientMonitor
from hf_stable.callbacks.guards import SkipGuard, build_guards
from hf_stable.config.guards import GuardsConfig
from hf_stable.distributed import shutdown
from hf_stable.trainer import StableTrainer


def main(out: str) -> None:
    faulthandler.dump_traceback_later(int(os.environ.get("GUARDS_DDP_TIMEOUT", "150")), exit=True)
    batch = int(os.environ.get("GUARDS_DDP_BATCH", "2"))  # per rank; 1: each rank's step loss is one record's
    if os.environ.get("GUARDS_DDP_TRAINERS", "both") == "both":
        run(out, Trainer, batch=batch)
    run(str(Path(out, "stable")), StableTrainer, first=[GradientMonitor()], batch=batch)
    shutdown()  # leave together: a gloo rank whose peer already exited can abort at interpreter shutdown
    # Results are on disk. Skip interpreter finalisation: torch's gloo teardown at exit sometimes aborts
    # ("terminate called without an active exception", ~1 run in 10 here), which would fail a correct run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(out: str, trainer_cls, first=(), batch: int = 2) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    model = tiny_lora_llama()
    LossFault(model, [3], rank=1)
    guards = build_guards(GuardsConfig())
    rec = Recorder(model)
    args = training_args(out, max_steps=10, per_device_train_batch_size=batch)
    callbacks = [*first, GradFaultOnRank(step=6, rank=1), *guards, rec, WeightDamage(model, [7], rank=1)]
    trainer = trainer_cls(model=model, args=args, train_dataset=token_data(64), callbacks=callbacks)
    trainer.train()
    skip = next(g for g in guards if isinstance(g, SkipGuard))
    rank = args.process_index
    result = {
        "world_size": args.world_size,
        "skipped": skip.skipped_steps,
        "unchanged_at": [s for s in range(1, 11) if weights_equal(rec.weights[s - 1], rec.weights[s])],
        "restored_to_start": weights_equal(rec.weights[8], rec.weights[0]),
        "finite": all_finite(rec.weights[10]),
        "events": [{k: v for k, v in e.items() if k != "time"} for g in guards for e in g.events],
    }
    torch.save(rec.weights[10], Path(out, f"rank{rank}.pt"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
