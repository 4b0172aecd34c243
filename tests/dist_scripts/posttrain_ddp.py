"""Two-rank DDP runs (gloo, CPU) of real TRL trainers under `hf_stable.stabilize`: DPO, then GRPO; each rank writes
OUT/<kind>/rank<i>.json and its final trainable weights OUT/<kind>/rank<i>.pt.

Launched by tests/test_posttrain_ddp.py as `torchrun --nproc_per_node 2 posttrain_ddp.py OUT`. Faults on rank 1 only:
step 3 a NaN forward (DDP's all-reduce spreads it to both ranks' gradients), step 5 one gradient NaN *after* the
all-reduce (only the agreed decision keeps rank 0 from stepping); GRPO, step 6: the importance ratios x22026 on rank 1
(its `damaged` counts ride in the gathered statistics). Both ranks must skip steps 3 and 5 (and 6), write the same
events (a skipped DPO step names both ranks' pairs, gathered) and end with bitwise identical finite weights. `POSTTRAIN_DDP_ENGINE=zero2` runs under DeepSpeed ZeRO-2 (the
forward fault only), `POSTTRAIN_DDP_KINDS` picks the trainers.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from engines import deepspeed_config
from guards_common import GradFaultOnRank
from posttrain_common import RolloutFaults, StepFaults, all_finite, build_trainer

import hf_stable
from hf_stable.callbacks.guards import SkipGuard
from hf_stable.core.engine import StepEngine
from hf_stable.distributed import shutdown


def run(out: Path, kind: str, engine: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if engine == "ddp":
        extra, first = {"ddp_find_unused_parameters": False}, [GradFaultOnRank(step=5, rank=1)]
    else:  # ZeRO: the gradients live in DeepSpeed's partitions (no p.grad to edit): the forward fault only
        extra, first = {"deepspeed": deepspeed_config(int(engine[-1]))}, []
    trainer = build_trainer(kind, out, max_steps=7, callbacks=first, **extra)
    faults = StepFaults(trainer.model, nan_forward=[3], rank=1)
    trainer.add_callback(faults)
    if kind == "grpo" and engine == "ddp" and trainer.args.process_index == 1:
        RolloutFaults(trainer, ratio=[6])  # step 6: this rank's importance ratios x22026 -> skipped on both
    hf_stable.stabilize(trainer).train()
    ours = [c for c in trainer.callback_handler.callbacks if hasattr(c, "events")]
    skip = next(c for c in ours if isinstance(c, SkipGuard))
    rank = trainer.args.process_index
    result = {
        "world_size": trainer.args.world_size,
        "engine": StepEngine.of(trainer.model).name,
        "skipped": skip.skipped_steps,
        "finite": all_finite(faults.weights[7]),
        "unchanged_at": [
            s for s in (3, 5, 6) if all(torch.equal(faults.weights[s - 1][k], v) for k, v in faults.weights[s].items())
        ],
        "events": [e["kind"] for c in ours for e in c.events if e["kind"] != "objective_not_judged"],
        "pairs": {e["step"]: e["records"] for c in ours for e in c.events if e["kind"] == "step_pairs"},
    }
    torch.save(faults.weights[7], out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def main(out: str) -> None:
    faulthandler.dump_traceback_later(int(os.environ.get("POSTTRAIN_DDP_TIMEOUT", "250")), exit=True)
    engine = os.environ.get("POSTTRAIN_DDP_ENGINE", "ddp")
    for kind in os.environ.get("POSTTRAIN_DDP_KINDS", "dpo,grpo").split(","):
        run(Path(out, kind), kind, engine)
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
