"""One 2-rank run (gloo, CPU) of `StableTrainer` with hf_stable's default monitors and guards under one engine:
DDP, DeepSpeed ZeRO-1/2/3 or FSDP2, on the same data and the same initial weights.

Launched by tests/test_engines.py as `torchrun --nproc_per_node 2 engines_run.py ENGINE OUT [stock]` (`stock`: the
stock `transformers.Trainer` with the same callbacks instead of `StableTrainer`). Each rank writes
OUT/rank<i>.json (per-step global and per-group gradient norms, skipped steps, events, whether this rank's weights
and optimizer state were unchanged over each skipped step, whether the rollback restored the snapshot bitwise) and
OUT/rank<i>.pt (this rank's part of the final trainable weights).

Faults, on rank 1 only: the loss is NaN at step 4 (so the reduced gradient is NaN on both ranks), and after step 9
rank 1's part of every LoRA B is NaN (an overflowing update): steps 10 and 11 are then bad on both ranks, the third
bad step within the window makes `RollbackGuard` restore its last snapshot.

FSDP2 on CPU: accelerate makes an `fsdp_plugin` a `DistributedType.FSDP` state only for GPU-like distributed types;
`fsdp_cpu.enable()` (test-only) lets the stock path run on gloo (see its docstring for what a GPU run adds).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import fsdp_cpu
import torch
from engines import engine_args, full_weights
from guards_common import LossFault, tiny_lora_llama, token_data, training_args
from transformers import Trainer, TrainerCallback

from hf_stable.callbacks import GradientMonitor
from hf_stable.callbacks.guards import RollbackGuard, SkipGuard, build_guards
from hf_stable.config.guards import GuardsConfig
from hf_stable.core.engine import StepEngine
from hf_stable.core.snapshot import optimizer_params
from hf_stable.distributed import shutdown
from hf_stable.optim.phases import unwrap_optimizer
from hf_stable.trainer import StableTrainer

STEPS = 14
DAMAGE_AFTER = 9


def local_state(model, optimizer) -> dict:
    """This rank's part of every trainable weight and of the optimizer's parameters and state, copied."""
    engine = StepEngine.of(model)
    opt = unwrap_optimizer(optimizer)
    weights = [engine.local(p).clone() for p in model.parameters() if p.requires_grad]
    masters = optimizer_params(optimizer)  # ZeRO: its fp32 partitions
    params = [engine.local(p).clone() for p in masters]
    state = [
        engine.local(v).clone() if isinstance(v, torch.Tensor) else v
        for p in masters
        for _, v in sorted(opt.state.get(p, {}).items())
    ]
    return {"weights": weights, "params": params, "state": state}


def damage_targets(engine, param) -> list[torch.Tensor]:
    """What an overflowing update corrupts on this rank: its part of the weights the forward reads and, under
    DeepSpeed, of ZeRO's fp32 master copy (else the next applied step would overwrite the damage)."""
    out = [engine.local(param)]
    if engine.name == "deepspeed_zero3":
        from deepspeed.utils import safe_get_local_fp32_param

        out.append(safe_get_local_fp32_param(param))
        if param.data.numel():  # a persistent (small) parameter stays gathered between steps
            out.append(param.data)
    elif engine.name.startswith("deepspeed") and param._hp_mapping is not None:
        out.append(param._hp_mapping.get_hp_fragment())
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):  # bitwise (NaN equals NaN)
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class Probe(TrainerCallback):
    """Records the gradient report of every step, the local state after every step, and damages rank 1's LoRA B."""

    def __init__(self, model, monitor: GradientMonitor):
        self.model, self.monitor = model, monitor
        self.norms: dict[int, dict] = {}
        self.after: dict[int, dict] = {}

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.after[0] = local_state(self.model, optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        step = state.global_step
        report = self.monitor.last_report
        if report is not None and report.step == step - 1:
            self.norms[step] = {"global": report.global_norm, **report.group_norms}
        if step == DAMAGE_AFTER and args.process_index == 1:
            engine = StepEngine.of(self.model)
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if "lora_B" in name:
                        for t in damage_targets(engine, p):
                            t.fill_(float("nan"))
        self.after[step] = local_state(self.model, optimizer)


def main(engine: str, out: str, trainer_cls=StableTrainer) -> None:
    faulthandler.dump_traceback_later(int(os.environ.get("ENGINES_TIMEOUT", "200")), exit=True)
    if engine == "fsdp2":
        fsdp_cpu.enable()
    Path(out).mkdir(parents=True, exist_ok=True)
    model = tiny_lora_llama()  # before TrainingArguments: ZeRO-3's zero.Init would partition it at construction
    LossFault(model, [4], rank=1)
    args = training_args(
        out, max_steps=STEPS, per_device_train_batch_size=2, lr_scheduler_type="linear", **engine_args(engine)
    )
    guards = build_guards(GuardsConfig())
    monitor = GradientMonitor(every_n_steps=1)
    probe = Probe(model, monitor)
    trainer = trainer_cls(model=model, args=args, train_dataset=token_data(64), callbacks=[monitor, *guards, probe])
    trainer.train()
    skip = next(g for g in guards if isinstance(g, SkipGuard))
    rollback = next(g for g in guards if isinstance(g, RollbackGuard))
    rank = args.process_index
    events = [{k: v for k, v in e.items() if k != "time"} for c in (monitor, *guards) for e in c.events]
    rolled = [e for e in events if e["kind"] == "rollback"]
    result = {
        "engine": StepEngine.of(model).name,
        "world_size": args.world_size,
        "norms": probe.norms,
        "skipped": skip.skipped_steps,
        "unchanged_over_skip": {s: same(probe.after[s - 1], probe.after[s]) for s in skip.skipped_steps},
        "restored": [same(probe.after[e["value"]], probe.after[e["step"]]) for e in rolled],
        "rollbacks": [(e["step"], e["value"]) for e in rolled],
        "lr_factor": rollback.lr_control.factor("rollback") if rollback.lr_control is not None else 1.0,
        "finite": all(bool(torch.isfinite(t).all()) for t in probe.after[STEPS]["weights"]),
        "events": events,
        "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
        "global_step": trainer.state.global_step,
    }
    torch.save(full_weights(model), Path(out, f"rank{rank}.pt"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Trainer if sys.argv[3:] == ["stock"] else StableTrainer)
