"""`build_guards(cfg)`: the guards a `GuardsConfig` asks for, wired to each other and listed in hook order.

Order matters inside `on_pre_optimizer_step`: the skip guard judges first (its verdict is agreed over ranks),
rollback and clipping read that verdict, and `LRControl` applies the LR factors last (it also re-applies a
factor changed later in the same hook, so it is order-robust). `guard_training_overrides` gives the
TrainingArguments values the guards need (clipping owned by hf_stable; accumulation driven by the guards).
"""

from __future__ import annotations

import warnings

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.accumulation_control import AccumulationControl
from hf_stable.callbacks.guards.batch_warmup_guard import BatchWarmupGuard
from hf_stable.callbacks.guards.clip_guard import ClipGuard
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.callbacks.guards.optimizer_phase_guard import OptimizerPhaseGuard
from hf_stable.callbacks.guards.rollback_guard import RollbackGuard
from hf_stable.callbacks.guards.skip_guard import SkipGuard
from hf_stable.callbacks.guards.snr_guard import SNRGuard
from hf_stable.callbacks.guards.thermal_guard import ThermalGuard

# Every event kind the guards write (the report groups events by kind).
GUARD_EVENT_KINDS = {
    "step_skipped": "an optimizer step skipped on every rank (non-finite, grad-norm spike, loss spike, loss rise)",
    "skip_reference_reset": "a level persisted past max_consecutive_skips and became the new reference",
    "rollback": "weights and optimizer state restored from the last snapshot; LR backed off",
    "rollback_exhausted": "max_rollbacks reached; bad steps are only skipped from then on",
    "rollback_declined": "K bad steps, but not from damaged weights (the batch is as bad at the snapshot's, or a "
    "repeat restore for non-finite steps): skipped only, no rollback",
    "rollback_held": "more bad steps right after a rollback with nothing applied since: skipped, no new backoff",
    "lr_adjusted": "the SNR rule changed its LR factor",
    "optimizer_switch": "the optimizer phase changed (AdamW -> SGD -> Lion ...)",
    "accumulation_changed": "gradient accumulation changed (batch warmup, thermal guard), LR compensated",
    "thermal_throttle": "GPU hot: accumulation and LR lowered",
    "thermal_restore": "GPU cool again: accumulation and LR restored",
    "guard_off": "a guard cannot act here (the stock Trainer under DeepSpeed, no NVML) and does nothing",
    "guard_notice": "a configuration caveat (e.g. the Trainer also clips)",
    "no_learning_signal": "a step with an exactly zero gradient: applied, not a spike reference (noted once)",
    "objective_not_judged": "a TRL preference / RL trainer without hf_stable.stabilize: the guards judge the NLL",
}


def build_guards(cfg, training: dict | None = None) -> list[StabilityCallback]:
    """Instantiate the guards enabled in `cfg` (a `GuardsConfig`); empty when `cfg.enabled` is False.

    Args:
        cfg: the `stability.guards` section.
        training: the recipe's `training:` mapping (TrainingArguments kwargs); batch warmup and the thermal guard
            read the target `gradient_accumulation_steps` from it.

    Example:
        >>> from hf_stable.config import GuardsConfig
        >>> guards = build_guards(GuardsConfig())
        >>> trainer = Trainer(..., args=TrainingArguments(..., max_grad_norm=0), callbacks=guards)
    """
    if not cfg.enabled:
        return []
    training = training or {}
    lr = LRControl(cfg.lr)
    out: list[StabilityCallback] = []
    skip = SkipGuard(cfg.skip) if cfg.skip.enabled else None
    clip = ClipGuard(cfg.clipping, skip_guard=skip) if cfg.clipping.enabled else None
    if skip is not None:
        out.append(skip)
        if cfg.rollback.enabled:  # the adaptive clip statistics roll back with the weights too
            out.append(RollbackGuard(skip, lr, cfg.rollback, followers=[clip] if clip else None))
    if clip is not None:
        out.append(clip)
    if cfg.snr.enabled:
        out.append(SNRGuard(lr, cfg.snr, skip_guard=skip))
    if cfg.phases.enabled:
        out.append(OptimizerPhaseGuard(lr, cfg.phases))
    if cfg.batch_warmup.enabled or cfg.thermal.enabled:
        rule = cfg.batch_warmup.lr_rule if cfg.batch_warmup.enabled else cfg.thermal.lr_rule
        target = cfg.batch_warmup.target_accumulation or int(training.get("gradient_accumulation_steps", 1))
        acc = AccumulationControl(lr, target=target, lr_rule=rule)
        if cfg.batch_warmup.enabled:
            out.append(BatchWarmupGuard(acc, cfg.batch_warmup))
        if cfg.thermal.enabled:
            out.append(ThermalGuard(acc, cfg.thermal))
        out.append(acc)
    out.append(lr)
    return out


def guard_training_overrides(cfg, training: dict | None = None, warn: bool = True) -> dict:
    """TrainingArguments values the enabled guards need, to pass as `training_arguments(cfg, **overrides)`.

    * clipping on: `max_grad_norm=0` (hf_stable clips; the Trainer would clip first and hide the pre-clip norms).
      A user value > 0 is overridden with a warning.
    * batch warmup / thermal on: `gradient_accumulation_steps=1` (the Trainer sizes its epoch loop from it; the
      guards set the real value at train start and between steps). Needs `max_steps > 0`; the target is the
      user's `training.gradient_accumulation_steps`, passed to `build_guards(cfg, training)`.
    """
    training = training or {}
    out: dict = {}
    if not cfg.enabled:
        return out
    if cfg.clipping.enabled:
        user = training.get("max_grad_norm")
        if warn and user not in (None, 0, 0.0):
            warnings.warn(
                f"training.max_grad_norm={user} is ignored: stability.guards.clipping ({cfg.clipping.mode}) clips "
                "instead; set stability.guards.clipping.enabled: false to use the Trainer's clipping",
                stacklevel=2,
            )
        out["max_grad_norm"] = 0.0
    if cfg.batch_warmup.enabled or cfg.thermal.enabled:
        out["gradient_accumulation_steps"] = 1  # the loop is sized for the smallest value; the guard raises it
    return out
