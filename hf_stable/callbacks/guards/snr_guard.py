"""`SNRGuard`: lower a persistent LR factor when the gradient norm leaves its healthy band, on top of the schedule.

Every `interval` steps the "current" grad norm (mean of the last `current_window` accepted steps; 1 = the literal
last step, noisier) is compared with a slow EMA (0.95) of the norm. A ratio above `high_ratio` (1.5: gradients
far above their recent level, instability building) multiplies the `snr` LR factor by `decrease` (0.8). While the
factor is below 1, a ratio back under `recover_ratio` (1.1) multiplies it by `increase` (1.1), so the LR returns to
the schedule once the norm is back in band; a ratio below `low_ratio` (0.7: the signal fading into noise) raises it
the same way. The factor is clamped to [min_factor, max_factor]; max_factor 1 (the default) never lifts the LR
above the schedule. The factor lives in `LRControl`, so it composes with the scheduler instead of being
overwritten by it.

Calibration (`benchmarks/rescue.py`, clean case, seeds 0-2, a check every 10 steps of 100): once the reference
has history, a healthy run's ratio stays within 0.86-1.23: inside [low_ratio, high_ratio] = [0.7, 1.5], where a
factor at 1 is left alone (and one below 1 recovers once the ratio is back under 1.1). Before that it does not: the
EMA starts at the first norm, and a LoRA fine-tune's norm grows over its first steps (B starts at zero, the LR
warms up), which read 1.35-1.55 at steps 10-20 and, with the old cut at 1.3, lowered the LR of every clean run. So no check is made until the EMA has seen `1 / (1 - ema_beta)` accepted norms (its time
constant, 20 by default) before the current window.

Norms are the pre-clip global norms from the shared `GradStats` report (identical on every rank after DDP's
all-reduce), and skipped steps are not learned from, so every rank takes the same decision without a collective
of its own. The rule is a heuristic, not a law: it is off by default, and `benchmarks/rescue.py` is where its
effect is measured.
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
        self._seen = 0  # accepted norms learned so far
        self._adjustments = 0

    @property
    def warmup(self) -> int:
        """Accepted norms needed before the first check: the EMA's time constant plus the current window."""
        return round(1 / (1 - self.ema_beta)) + self.current_window

    def state_dict(self) -> dict:
        return {"ema": self._ema, "recent": list(self._recent), "seen": self._seen, "adjustments": self._adjustments}

    def load_state_dict(self, state: dict) -> None:
        self._ema = None if state.get("ema") is None else float(state["ema"])
        self._recent = deque((float(x) for x in state.get("recent", [])), maxlen=self.current_window)
        self._seen = int(state.get("seen", self.warmup if self._ema is not None else 0))  # older states: warm
        self._adjustments = int(state.get("adjustments", 0))

    # --- decisions (pure) ------------------------------------------------------------------------------------
    def observe(self, step: int, grad_norm: float) -> float | None:
        """Learn one accepted step's norm; at check steps adjust the factor. Returns the ratio when checked."""
        if not math.isfinite(grad_norm):
            return None
        self._recent.append(grad_norm)
        self._seen += 1
        ratio = None
        if step % self.interval == 0 and self._seen >= self.warmup and self._ema is not None and self._ema > 0:
            ratio = (sum(self._recent) / len(self._recent)) / self._ema
            old = self.lr_control.factor("snr")
            new, threshold = old, self.high_ratio
            if ratio > self.high_ratio:  # far outside the healthy band
                new = old * self.decrease
            elif ratio < self.low_ratio:  # the signal fading: up to max_factor
                new, threshold = old * self.increase, self.low_ratio
            elif old < 1 and ratio < self.recover_ratio:  # back in band: toward the schedule, not above it
                new, threshold = min(old * self.increase, 1.0), self.recover_ratio
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
                    threshold=threshold,
                    severity="info",
                    factor=new,
                )
        b = self.ema_beta
        self._ema = grad_norm if self._ema is None else b * self._ema + (1 - b) * grad_norm
        return ratio

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.enabled or model is None or self.engine_unhosted(state, model):
            return
        step = state.global_step + 1
        verdict = self.skip_guard.verdict_for(step) if self.skip_guard is not None else None
        if verdict is not None and verdict.skip:
            return
        report = GradStats.shared(model).compute(model, step=state.global_step)
        if report.available:
            self.observe(step, report.global_norm)
