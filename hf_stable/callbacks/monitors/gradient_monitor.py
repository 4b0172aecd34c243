"""`GradientMonitor`: gradient health every step — norms per group, max |grad| and where, explosion / vanishing.

It reads the shared `GradStats` result in `on_pre_optimizer_step` (gradients accumulated, all-reduced, unscaled).
Pre- or post-clip: with `TrainingArguments.max_grad_norm > 0` a stock Trainer has already clipped by then, so the
numbers are post-clip and the monitor says so once; `hf_stable.trainer.StableTrainer` takes the statistics before
its clip (pre-clip numbers), and the hf_stable recipe sets `max_grad_norm=0` and clips per group in a guard.
Under DDP the gradients are already averaged over ranks at this hook, so every rank reports the same numbers.
Under DeepSpeed there is no `p.grad`: the monitor says once that it is off and logs nothing (never zeros).
"""

from __future__ import annotations

import math

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.config.stability import GradMonitorConfig
from hf_stable.core.grad_stats import GradReport, GradStats
from hf_stable.core.monitor_utils import AlertGate, logs_at


class GradientMonitor(StabilityCallback):
    """Logs `grad/norm_global`, `grad/norm/<group>`, `grad/max_abs`, `grad/nonfinite_*`; alerts on explosion,
    vanishing and a huge single gradient element.

    Args:
        config: a `GradMonitorConfig` (default `GradMonitorConfig()`; every field is documented there and in
            docs/CONFIG.md).
        **overrides: `GradMonitorConfig` fields to change, e.g. `GradientMonitor(explosion_norm=1e3)`.

    Example:
        >>> trainer = Trainer(..., callbacks=[GradientMonitor(explosion_norm=1e3)])
    """

    def __init__(self, config: GradMonitorConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(GradMonitorConfig, config, overrides)
        self._gate = AlertGate(cfg.cooldown_steps)
        self._vanishing_streak = 0
        self._checks = 0
        self._off_reason: str | None = None
        self._post_clip = False
        self.last_report: GradReport | None = None

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"vanishing_streak": self._vanishing_streak, "checks": self._checks, "gate": self._gate.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._vanishing_streak = int(state.get("vanishing_streak", 0))
        self._checks = int(state.get("checks", 0))
        self._gate.load_state_dict(state.get("gate", {}))

    # --- decisions (pure: testable on constructed traces) ------------------------------------------
    def observe(self, step: int, report: GradReport) -> list[dict]:
        """Judge one step's report; returns the events it wrote."""
        if not report.available:
            return []
        self._checks += 1
        events = []
        norm = report.global_norm
        if math.isfinite(norm) and norm > self.explosion_norm:
            events += self._alert(
                step,
                "grad_explosion",
                None,
                norm,
                self.explosion_norm,
                "error",
                f"global grad norm {norm:.4g} > {self.explosion_norm:g} (largest group: {_largest(report)})",
            )
        if norm == 0.0:  # exactly zero: no learning signal in this batch (equal rewards in a GRPO group ...), not a
            # vanishing gradient; it neither counts towards nor breaks a vanishing streak (SkipGuard notes it once)
            pass
        elif math.isfinite(norm) and norm < self.vanishing_norm:
            self._vanishing_streak += 1
            if self._vanishing_streak >= self.vanishing_patience:
                events += self._alert(
                    step,
                    "grad_vanishing",
                    None,
                    norm,
                    self.vanishing_norm,
                    "warning",
                    f"global grad norm {norm:.3g} < {self.vanishing_norm:g} for {self._vanishing_streak} "
                    "consecutive checks (frozen/detached parameters, LR/loss scale, all labels masked?)",
                )
        else:
            self._vanishing_streak = 0
        if math.isfinite(report.max_abs) and report.max_abs > self.max_abs:
            events += self._alert(
                step,
                "grad_max_abs",
                report.max_abs_group,
                report.max_abs,
                self.max_abs,
                "warning",
                f"max |grad| {report.max_abs:.4g} > {self.max_abs:g} in {report.max_abs_param}",
                param=report.max_abs_param,
            )
        return events

    def _alert(self, step, kind, group, value, threshold, severity, message, **extra) -> list[dict]:
        suppressed = self._gate.allow(step, kind, group)
        if suppressed is None:
            return []
        if suppressed:
            message += f" ({suppressed} similar alerts suppressed since the last one)"
        return [
            self.event(step, kind, message, group=group, value=value, threshold=threshold, severity=severity, **extra)
        ]

    # --- Trainer hooks ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        if not self.enabled:
            return
        self._off_reason = None
        pre_clip = model is not None and GradStats.shared(model).pre_clip  # StableTrainer reads before clipping
        self._post_clip = bool(args.max_grad_norm and args.max_grad_norm > 0) and not pre_clip
        if self._post_clip and self._off_reason is None:
            self.event(
                state.global_step,
                "monitor_notice",
                f"gradient statistics are post-clip: TrainingArguments.max_grad_norm={args.max_grad_norm} clips "
                "before any callback sees the gradients; set max_grad_norm=0 and clip with the hf_stable guard "
                "for pre-clip numbers",
                severity="info",
            )

    def _say_off(self, state, reason: str) -> None:
        if self._off_reason is None:
            self._off_reason = reason
            self.event(state.global_step, "monitor_off", f"gradient monitors are off: {reason}", severity="info")

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.enabled or self._off_reason is not None or model is None:
            return
        if (state.global_step + 1) % self.every_n_steps or self.engine_unhosted(state, model):
            return
        stats = GradStats.shared(model)
        # The exact max |g| costs a second pass over the gradients: take it at logging steps (for the metric),
        # and otherwise only when the largest per-tensor L2 norm - an upper bound of it - crosses the threshold.
        log_step = logs_at(args, state.global_step + 1)
        read = lambda: self._read(stats, model, state, log_step)
        if not stats.readers.defer(state.global_step, read, max_abs=log_step):  # else: at the skip guard's gather
            read()

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            GradStats.shared(model).readers.flush(state.global_step)  # a deferred read no gather ran (rank-agreed)

    def _read(self, stats: GradStats, model, state, log_step: bool) -> None:
        report = stats.compute(model, step=state.global_step, max_abs=log_step)
        if not report.available:
            self._say_off(state, report.reason)
            return
        if not report.has_max_abs and report.max_param_norm > self.max_abs:
            report = stats.compute(model, step=state.global_step, max_abs=True)
        self.last_report = report
        if log_step:  # metrics only matter in the log line they are merged into
            self.record(report.metrics())
        self.observe(state.global_step + 1, report)


def _largest(report: GradReport) -> str:
    finite = {g: v for g, v in report.group_norms.items() if math.isfinite(v)}
    if not finite:
        return "none finite"
    g = max(finite, key=finite.get)
    return f"{g} {finite[g]:.4g}"
