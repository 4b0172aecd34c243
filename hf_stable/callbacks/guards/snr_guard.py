"""`SNRGuard`: nudge a persistent LR factor from the gradient-norm signal, on top of the schedule.

Every `interval` steps the "current" grad norm (mean of the last `current_window` accepted steps; 1 = the literal
last step, noisier) is compared with a slow EMA (0.95) of the norm. A ratio above `high_ratio` (1.3: gradients
growing — instability building) multiplies the `snr` LR factor by `decrease` (0.8); a ratio below `low_ratio`
(0.7: gradients shrinking — the signal fades into noise) multiplies it by `increase` (1.1). The factor is
clamped to [min_factor, max_factor] and lives in `LRControl`, so it composes with the scheduler instead of
being overwritten by it. Norms are the pre-clip global norms from the shared `GradStats` report (identical on
every rank after DDP's all-reduce), and skipped steps are not learned from, so every rank takes the same
decision without a collective of its own.

The rule is a heuristic from field notes, not a law: it is off by default, and `benchmarks/rescue.py` is where
its effect is measured.
"""

from __future__ import annotations

import math
from collections import deque

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.config.guards import SNRConfig
from hf_stable.core.grad_stats import GradStats


class SNRGuard(StabilityCallback):
    """Adjusts the `snr` LR factor every `interval` steps from current-vs-EMA grad norm; event `lr_adjusted`.

    Args:
        lr_control: the `LRControl` holding the factor.
        config: an `SNRConfig` (default `SNRConfig()` switched on; every field is documented there and in
            docs/CONFIG.md).
        skip_guard: the `SkipGuard` (listed before this guard); skipped steps are ignored.
        **overrides: `SNRConfig` fields to change, e.g. `SNRGuard(lr, interval=100)`.

    Example:
        >>> lr = LRControl()
        >>> callbacks = [SNRGuard(lr, interval=100), lr]
    """

    def __init__(self, lr_control: LRControl, config: SNRConfig | None = None, *, skip_guard=None, **overrides):
        super().__init__()
        cfg = self._use_config(SNRConfig, config, overrides)
        current_window = cfg.current_window
        self.lr_control = lr_control
        self.skip_guard = skip_guard
        self._ema: float | None = None
        self._recent: deque[float] = deque(maxlen=current_window)
        self._adjustments = 0

    def state_dict(self) -> dict:
        return {"ema": self._ema, "recent": list(self._recent), "adjustments": self._adjustments}

    def load_state_dict(self, state: dict) -> None:
        self._ema = None if state.get("ema") is None else float(state["ema"])
        self._recent = deque((float(x) for x in state.get("recent", [])), maxlen=self.current_window)
        self._adjustments = int(state.get("adjustments", 0))

    # --- decisions (pure) ------------------------------------------------------------------------------------
    def observe(self, step: int, grad_norm: float) -> float | None:
        """Learn one accepted step's norm; at check steps adjust the factor. Returns the ratio when checked."""
        if not math.isfinite(grad_norm):
            return None
        self._recent.append(grad_norm)
        ratio = None
        if step % self.interval == 0 and self._ema is not None and self._ema > 0:
            ratio = (sum(self._recent) / len(self._recent)) / self._ema
            old = self.lr_control.factor("snr")
            new = old
            if ratio > self.high_ratio:
                new = old * self.decrease
            elif ratio < self.low_ratio:
                new = old * self.increase
            new = min(max(new, self.min_factor), self.max_factor)
            self.record({"lr/snr_ratio": ratio})
            if new != old:
                self._adjustments += 1
                self.lr_control.set_factor("snr", new)
                self.event(
                    step,
                    "lr_adjusted",
                    f"grad norm {ratio:.3g}x its EMA: SNR LR factor {old:.3g} -> {new:.3g}",
                    value=ratio,
                    threshold=self.high_ratio if ratio > 1 else self.low_ratio,
                    severity="info",
                    factor=new,
                )
        b = self.ema_beta
        self._ema = grad_norm if self._ema is None else b * self._ema + (1 - b) * grad_norm
        return ratio

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.enabled or model is None:
            return
        step = state.global_step + 1
        verdict = self.skip_guard.verdict_for(step) if self.skip_guard is not None else None
        if verdict is not None and verdict.skip:
            return
        report = GradStats.shared(model).compute(model, step=state.global_step)
        if report.available:
            self.observe(step, report.global_norm)
