"""Two-rank DDP run (gloo, CPU): a repeat rollback for non-finite steps is declined on both ranks together.

Launched by tests/test_guards_ddp.py as `torchrun --nproc_per_node 2 repeat_nonfinite_ddp.py OUT`. Rank 1 alone
overflows (loss x inf, every forward of the step, re-runs included) at steps 5-7 and 15-17 whenever the weights have
moved from the initial ones; DDP spreads the non-finite gradients to rank 0. Steps 5-7: the rollback check's
all-reduced re-runs say "damaged" -> both ranks restore step 0 (LR x0.5). Steps 15-17, after steps 8-14 were
applied: a repeat for non-finite steps only -> the weights-finite flag is agreed over the ranks (a collective that
every rank enters) and both decline. Each rank writes OUT/rank<i>.json and its final weights OUT/rank<i>.pt.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from guards_common import OverflowPhases, Recorder, all_finite, tiny_lora_llama, token_data, training_args
from transformers import Trainer

from hf_stable.callbacks.guards import LRControl, RollbackGuard, SkipGuard
from hf_stable.distributed import shutdown

PHASES = (5, 6, 7, 15, 16, 17)


def main(out: str) -> None:
    faulthandler.dump_traceback_later(int(os.environ.get("GUARDS_DDP_TIMEOUT", "150")), exit=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    model = tiny_lora_llama()
    OverflowPhases(model, PHASES, rank=1)
    skip, lr = SkipGuard(), LRControl()
    rollback = RollbackGuard(skip, lr, snapshot_share=None, snapshot_every=1000)
    rec = Recorder(model)
    args = training_args(out, max_steps=20, per_device_train_batch_size=2, learning_rate=1e-2)
    Trainer(model=model, args=args, train_dataset=token_data(128), callbacks=[skip, rollback, lr, rec]).train()
    result = {
        "skipped": skip.skipped_steps,
        "events": [{k: v for k, v in e.items() if k != "time"} for g in (skip, rollback) for e in g.events],
        "rollbacks": rollback.rollbacks,
        "lr_factor": lr.product,
        "finite": all_finite(rec.weights[20]),
    }
    torch.save(rec.weights[20], Path(out, f"rank{args.process_index}.pt"))
    Path(out, f"rank{args.process_index}.json").write_text(json.dumps(result, default=str))
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as guards_ddp.py: skip gloo's teardown at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
