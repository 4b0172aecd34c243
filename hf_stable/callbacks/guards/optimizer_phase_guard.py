"""`OptimizerPhaseGuard`: switches a `PhasedOptimizer` (`hf_stable/optim/phases.py`) at the configured steps or when
the loss flattens. The switch is decided from `global_step` or from the per-step loss that `GradStats` already sums
over ranks, so every rank switches at the same step."""

from __future__ import annotations

import math

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.config.guards import OptimizerPhasesConfig
from hf_stable.core.grad_stats import GradStats
from hf_stable.core.step_tap import StepTapUser
from hf_stable.errors import ConfigError
from hf_stable.optim.phases import PhasedOptimizer, unwrap_optimizer


class OptimizerPhaseGuard(StepTapUser, StabilityCallback):
    """Switches a `PhasedOptimizer` at the configured steps or when the loss flattens; event `optimizer_switch`.

    Args:
        lr_control: the `LRControl` holding the `phase` LR factor.
        config: an `OptimizerPhasesConfig` (default: its three phases, switched on; every field is documented
            there and in docs/CONFIG.md; `state_policy` is the `PhasedOptimizer`'s business).
        **overrides: `OptimizerPhasesConfig` fields to change, e.g. `OptimizerPhaseGuard(lr, phases=[...])`.

    Raises:
        ConfigError: at train start when the Trainer's optimizer is not a `PhasedOptimizer` with these phases.

    Example:
        >>> lr = LRControl()
        >>> callbacks = [OptimizerPhaseGuard(lr, cfg.stability.guards.phases), lr]
    """

    def __init__(self, lr_control: LRControl, config: OptimizerPhasesConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(OptimizerPhasesConfig, config, overrides)
        self.phases = list(cfg.phases)
        self.lr_control = lr_control
        self._prev_loss: float | None = None
        self._dloss_ema: float | None = None
        self._seen = 0
        self._optimizer: PhasedOptimizer | None = None

    def state_dict(self) -> dict:
        return {"prev_loss": self._prev_loss, "dloss_ema": self._dloss_ema, "seen": self._seen}

    def load_state_dict(self, state: dict) -> None:
        self._prev_loss = state.get("prev_loss")
        self._dloss_ema = state.get("dloss_ema")
        self._seen = int(state.get("seen", 0))

    @property
    def dloss_ema(self) -> float | None:
        return self._dloss_ema

    def observe_loss(self, loss: float) -> None:
        if not math.isfinite(loss):
            return
        if self._prev_loss is not None:
            d = abs(loss - self._prev_loss)
            b = self.dloss_ema_beta
            self._dloss_ema = d if self._dloss_ema is None else b * self._dloss_ema + (1 - b) * d
            self._seen += 1
        self._prev_loss = loss

    def due(self, phase: int, step: int) -> bool:
        """Whether phase `phase` ends after `step` completed steps."""
        if phase >= len(self.phases) - 1:
            return False
        cfg = self.phases[phase]
        if cfg.until_step is not None and step >= cfg.until_step:
            return True
        warm = self._seen >= int(1 / (1 - self.dloss_ema_beta))
        return (
            cfg.until_dloss_below is not None
            and warm
            and self._dloss_ema is not None
            and self._dloss_ema < cfg.until_dloss_below
        )

    def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
        super().on_train_begin(args, state, control, optimizer=optimizer, model=model, **kwargs)
        if not self.enabled:
            return
        opt = unwrap_optimizer(optimizer)
        names = [p.name for p in self.phases]
        if not isinstance(opt, PhasedOptimizer) or opt.names != names:
            raise ConfigError(
                f"stability.guards.phases: the Trainer's optimizer is {type(opt).__name__}; optimizer phases need "
                f"PhasedOptimizer(first_optimizer, {names}) passed as Trainer(optimizers=(opt, None))"
            )
        self._optimizer = opt
        self.lr_control.set_factor("phase", self.phases[opt.phase].lr_scale)
        self._use_step_tap(model)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.enabled and model is not None:
            report = GradStats.shared(model).compute(model, step=state.global_step)
            den = report.extras.get("loss_den", 0.0)
            if den:
                self.observe_loss(report.extras["loss_num"] / den)

    def on_step_end(self, args, state, control, **kwargs):
        opt = self._optimizer
        if self.enabled and opt is not None and self.due(opt.phase, state.global_step):
            old = opt.names[opt.phase]
            opt.switch(opt.phase + 1)
            self.lr_control.set_factor("phase", self.phases[opt.phase].lr_scale)
            why = (
                f"step {state.global_step} reached"
                if self.phases[opt.phase - 1].until_step is not None
                and state.global_step >= self.phases[opt.phase - 1].until_step
                else f"|dloss| EMA {self._dloss_ema:.3g} below {self.phases[opt.phase - 1].until_dloss_below:g}"
            )
            self.event(
                state.global_step,
                "optimizer_switch",
                f"optimizer {old} -> {opt.names[opt.phase]} after step {state.global_step} ({why}); state "
                f"policy {opt.state_policy}; LR factor {self.phases[opt.phase].lr_scale:g}",
                value=opt.phase,
                severity="info",
                previous=old,
                current=opt.names[opt.phase],
            )
        super().on_step_end(args, state, control, **kwargs)
