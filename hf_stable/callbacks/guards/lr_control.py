"""`LRControl`: persistent LR factors that compose with the Trainer's scheduler instead of fighting it.

The scheduler rewrites every `param_group["lr"]` at each `lr_scheduler.step()`, so a guard that sets the LR once
loses it one step later. Here each guard owns a named factor (`rollback`, `snr`, `accumulation`, `phase`); their
product (clamped) is applied on top of whatever the scheduler set:

* `on_pre_optimizer_step` (just before `optimizer.step()`): remember each group's scheduler LR, set
  `lr = scheduler_lr * product`.
* `on_optimizer_step` (just after it, before `lr_scheduler.step()`): put the scheduler's values back, so
  chainable schedulers that read `group["lr"]` never compound the factor.

Logged (group 0): `learning_rate` is the LR the optimizer applied (the Trainer's own value, the schedule's, is
replaced in `on_log`, so TensorBoard / W&B show what was used), `lr/scheduled` the schedule's value,
`lr/effective` the applied LR again (kept for existing dashboards) and `lr/factor` the product.

A factor changed inside that window (e.g. a rollback decided in `on_pre_optimizer_step` by a guard listed after
this one) is applied immediately, so the order of guards in the callback list does not matter here. Factors are
saved with the callback state and restored on resume.
"""

from __future__ import annotations

import math

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.config.guards import LRControlConfig
from hf_stable.optim.phases import unwrap_optimizer


class LRControl(StabilityCallback):
    """Multiplies each param group's scheduler LR by the product of named factors, every step.

    Args:
        config: an `LRControlConfig` (default `LRControlConfig()`: the clamp of the product of the factors).
        enabled: when False factors are kept but never applied.
        **overrides: `LRControlConfig` fields to change, e.g. `LRControl(min_factor=0.01)`.

    Example:
        >>> control = LRControl()
        >>> control.multiply("rollback", 0.5)          # persists across scheduler steps
        >>> trainer = Trainer(..., callbacks=[control])
    """

    def __init__(self, config: LRControlConfig | None = None, *, enabled: bool = True, **overrides):
        super().__init__(enabled)
        self._use_config(LRControlConfig, config, overrides)
        self._factors: dict[str, float] = {}
        self._named: set[str] = set()
        self._optimizer = None
        self._scheduler_lrs: list[float] | None = None  # set between pre-optimizer step and optimizer step

    # --- factors ---------------------------------------------------------------------------------
    @property
    def factors(self) -> dict[str, float]:
        return dict(self._factors)

    def factor(self, name: str) -> float:
        return self._factors.get(name, 1.0)

    @property
    def product(self) -> float:
        value = math.prod(self._factors.values()) if self._factors else 1.0
        return min(max(value, self.min_factor), self.max_factor)

    def set_factor(self, name: str, value: float) -> None:
        """Set factor `name` (1.0 removes it). Applied now if the optimizer step is under way, else next step."""
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"LR factor {name!r} must be a finite number > 0, got {value}")
        if value == 1.0:
            self._factors.pop(name, None)
        else:
            self._factors[name] = float(value)
        if self._scheduler_lrs is not None:
            self._apply()

    def multiply(self, name: str, by: float) -> float:
        """Multiply factor `name` by `by`; returns the new factor."""
        self.set_factor(name, self.factor(name) * by)
        return self.factor(name)

    # --- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"factors": dict(self._factors)}

    def load_state_dict(self, state: dict) -> None:
        self._factors = {k: float(v) for k, v in state.get("factors", {}).items()}

    # --- application ---------------------------------------------------------------------------------
    def _apply(self) -> None:
        groups = self._optimizer.param_groups
        product = self.product if self.enabled else 1.0
        for group, lr in zip(groups, self._scheduler_lrs, strict=False):
            group["lr"] = lr * product
        if self.enabled and self._scheduler_lrs:
            # recorded on every (re)application, so a factor set later in the step is what the log shows
            applied = groups[0]["lr"]
            self.record(
                {
                    "lr/factor": self.product,
                    "lr/effective": applied,
                    "learning_rate": applied,
                    "lr/scheduled": self._scheduler_lrs[0],
                }
            )
            self._named |= set(self._factors)
            # a factor back at 1.0 is logged as 1.0 (not left at its last value in a multi-step log line)
            self.record({f"lr/factor/{name}": self._factors.get(name, 1.0) for name in sorted(self._named)})

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is None:
            return
        self._optimizer = unwrap_optimizer(optimizer)
        self._scheduler_lrs = [g["lr"] for g in self._optimizer.param_groups]
        self._apply()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._scheduler_lrs is None:
            return
        for group, lr in zip(self._optimizer.param_groups, self._scheduler_lrs, strict=False):
            group["lr"] = lr
        self._scheduler_lrs = None
