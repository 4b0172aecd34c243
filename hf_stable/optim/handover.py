"""Hand the recipe's optimizer (`optim.factory.build_optimizer`) to the Trainer.

The recipe hands it to the Trainer as `optimizers=(optimizer, None)`: the Trainer still builds the
scheduler, and its LambdaLR scales each group from the group's own LR. Under FSDP the Trainer refuses a prebuilt
optimizer (FSDP1 replaces the parameters when it wraps the model; FSDP2 swaps them for DTensor shards in
`accelerator.prepare`), and under DeepSpeed it silently builds its own in place of it; `trainer_optimizer_factory`
gives the `optimizer_cls_and_kwargs=` form, which the Trainer calls on the model it is about to prepare instead.
`trainer_optimizer_arguments` picks the form for a run.
"""

from __future__ import annotations

import functools
import os

import torch

from hf_stable.config.optim import OptimConfig
from hf_stable.optim.factory import build_optimizer
from hf_stable.optim.phases import wrap_for_phases


class OptimizerFactory:
    """A Trainer optimizer factory: `Trainer(optimizer_cls_and_kwargs=trainer_optimizer_factory(cfg, args))`.

    The Trainer calls `OptimizerFactory()` then `(model)` on the model it will train (FSDP2: before sharding, and
    accelerate then moves the groups onto the shards; FSDP1: after wrapping), which is the only way to bring custom
    groups under FSDP, where `optimizers=(opt, None)` is refused, and under DeepSpeed, where it is dropped. With `phases` (`stability.guards.phases`, enabled)
    the optimizer is wrapped for the phase switches as the recipe wraps it.
    """

    def __init__(self, cfg: OptimConfig | None, args, overrides: dict | None = None, phases=None):
        self.cfg = cfg
        self.args = args
        self.overrides = overrides or {}
        self.phases = phases

    def __call__(self, model: torch.nn.Module, **kwargs) -> torch.optim.Optimizer:
        optimizer = build_optimizer(model, self.cfg, self.args, **{**self.overrides, **kwargs})
        if self.phases is not None and self.phases.enabled:
            optimizer = wrap_for_phases(optimizer, self.phases, self.cfg, self.args)
        return optimizer


def trainer_optimizer_factory(cfg: OptimConfig | None, args, *, phases=None, **overrides) -> tuple:
    """`(factory, {})` for `Trainer(optimizer_cls_and_kwargs=...)`; see `OptimizerFactory`."""
    return functools.partial(OptimizerFactory, cfg, args, overrides, phases), {}


def engine_builds_optimizer(args) -> str | None:
    """The engine that will not train a prebuilt optimizer in this run ("DeepSpeed", "FSDP"), or None.

    Under DeepSpeed the Trainer drops `optimizers=(opt, None)` without a word (`deepspeed_init` sets
    `trainer.optimizer = None` and builds its own two groups at the base LR: no layer-wise LR, no LoRA+); under FSDP
    it refuses it. Read from `TrainingArguments` (`deepspeed=`, `fsdp=`) or from the environment `accelerate launch`
    sets for a DeepSpeed / FSDP config, as the Trainer's accelerator reads it.
    """
    env = os.environ
    if getattr(args, "deepspeed", None) or env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true"):
        return "DeepSpeed"
    if getattr(args, "fsdp", None) or env.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return "FSDP"
    return None


def trainer_optimizer_arguments(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig | None, args, *, phases=None
) -> dict:
    """The Trainer keyword that hands the recipe's optimizer over: `optimizers=(optimizer, None)`, or under DeepSpeed
    and FSDP (see `engine_builds_optimizer`) `optimizer_cls_and_kwargs` with a factory that builds the same groups -
    same names, LRs (layer-wise decay, LoRA+) and weight decay - over the model the Trainer prepares.

    `optimizer` must be `build_optimizer(model, cfg, args)` (wrapped for `phases` when they are enabled); there it
    only served the group table and is dropped.

    Example:
        >>> trainer = Trainer(model=model, args=args, **trainer_optimizer_arguments(optimizer, cfg.optim, args))
    """
    if engine_builds_optimizer(args) is not None:
        return {"optimizer_cls_and_kwargs": trainer_optimizer_factory(cfg, args, phases=phases)}
    return {"optimizers": (optimizer, None)}
