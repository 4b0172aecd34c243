"""`LossMonitor`: loss spikes, a rising-and-accelerating loss (curvature rule), eval-loss plateau early stop.

Which loss: the Trainer passes no per-step loss to callbacks, and its logged `loss` is an average over the
logging interval with NaN replaced (`logging_nan_inf_filter`). The monitor uses the per-step loss recorded by
`StepTap` from the model's forward output, which rides in the step's single `GradStats` transfer and is summed
over ranks there, so it is the same on every rank and is never filtered. If the model returns no loss (a custom
`compute_loss`), it falls back to the logged `loss` at each logging step.

Spike rule: the log of the step loss more than `spike_zscore` (6) robust standard deviations (1.4826 MAD of the log
losses over the last `spike_window` (100) steps) above their median, and the loss at least `1 + spike_min_rel` (1.5)
x that median: the skip guard's measure (the guard, which acts, asks for 2x). Per-step losses at batch 1-2 are one or two records' losses, spread
multiplicatively and heavy-tailed (a hard question is 3x the median); on a linear scale the median absolute deviation
of such a series is small against its tail, and clean runs at batch 1 raised 6.4-sd "spikes" of an ordinary record.

Curvature rule: the field notes say "l[i] - 2 l[i-1] + l[i-2] > 0.1 for 5 consecutive checks". A healthy,
quickly *falling* loss is convex too (positive second difference), so the rule here also requires the loss to
be rising (l[i] > l[i-1]) at each of those checks; otherwise every good warm-up would alert.
"""

from __future__ import annotations

import math
from collections import deque

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.config.stability import LossMonitorConfig
from hf_stable.core.grad_stats import GradStats
from hf_stable.core.monitor_utils import AlertGate, logs_at, robust_zscore
from hf_stable.core.step_noise import LogWindow, log_z, median
from hf_stable.core.step_tap import StepTapUser


class LossMonitor(StepTapUser, StabilityCallback):
    """Logs `loss/train` (per step, unfiltered), `loss/zscore`, `loss/curvature`; events `loss_spike`,
    `loss_curvature`, `loss_plateau` (and stops training on a plateau when `plateau_early_stop`).

    Args:
        config: a `LossMonitorConfig` (default `LossMonitorConfig()`; every field is documented there and in
            docs/CONFIG.md).
        **overrides: `LossMonitorConfig` fields to change, e.g. `LossMonitor(spike_zscore=5.0)`.

    Example:
        >>> LossMonitor(spike_zscore=5.0, plateau_window=500)
    """

    def __init__(self, config: LossMonitorConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(LossMonitorConfig, config, overrides)
        self._gate = AlertGate(cfg.cooldown_steps)
        self._history: LogWindow = LogWindow(maxlen=cfg.spike_window)  # (logs taken once: `core.step_noise`)
        self._interval: list[float] = []
        self._checks: deque[float] = deque(maxlen=3)
        self._curv_streak = 0
        self._evals: list[tuple[int, float]] = []
        self._plateau_fired = False
        self._from_tap = False

    def state_dict(self) -> dict:
        return {
            "history": list(self._history),
            "interval": list(self._interval),
            "checks": list(self._checks),
            "curv_streak": self._curv_streak,
            "evals": [list(e) for e in self._evals],
            "plateau_fired": self._plateau_fired,
            "gate": self._gate.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._history = LogWindow((float(x) for x in state.get("history", [])), maxlen=self.spike_window)
        self._interval = [float(x) for x in state.get("interval", [])]
        self._checks = deque((float(x) for x in state.get("checks", [])), maxlen=3)
        self._curv_streak = int(state.get("curv_streak", 0))
        self._evals = [(int(s), float(v)) for s, v in state.get("evals", [])]
        self._plateau_fired = bool(state.get("plateau_fired", False))
        self._gate.load_state_dict(state.get("gate", {}))

    # --- decisions (pure: testable on constructed traces) ------------------------------------------
    def observe_loss(self, step: int, loss: float, metrics_due: bool = True) -> list[dict]:
        """Feed one step's training loss; returns the events written. Non-finite losses are not learned from.
        `metrics_due=False`: the step's metrics reach no log line (not a logging step), so its z-score is measured
        only when the loss is large enough to be a spike."""
        events: list[dict] = []
        metrics = {"loss/train": loss}
        if not math.isfinite(loss):
            self.record(metrics)
            return events  # NonFiniteLocator reports it; keep it out of the statistics
        if len(self._history) >= self.spike_min_history:
            history = list(self._history)
            mid = median(history)
            # the log z-score is defined for a positive loss over a positive history (losses spread
            # multiplicatively: a hard record is 3x the median, not +2); else the plain robust z-score, always judged
            logs = loss > 0 and self._history.positive
            big = loss > mid * (1 + self.spike_min_rel) if logs else True
            if big or metrics_due:
                z = log_z(loss, self._history) if logs else None
                if z is None:  # a loss that can be <= 0 (a custom objective): the plain robust z-score
                    z = robust_zscore(loss, history)
                metrics["loss/zscore"] = z
                if z > self.spike_zscore and big:
                    events += self._alert(
                        step,
                        "loss_spike",
                        loss,
                        self.spike_zscore,
                        "warning",
                        f"loss {loss:.4g} is {loss / mid if mid > 0 else math.inf:.2g}x the median {mid:.4g} of the "
                        f"last {len(history)} steps, {z:.1f} robust sd of their log losses above it "
                        f"(> {self.spike_zscore:g})",
                        zscore=z,
                    )
        self._history.append(loss)
        self._interval.append(loss)
        if len(self._interval) >= self.curvature_interval:
            events += self._curvature_check(step, sum(self._interval) / len(self._interval), metrics)
            self._interval = []
        self.record(metrics)
        return events

    def _curvature_check(self, step: int, value: float, metrics: dict) -> list[dict]:
        self._checks.append(value)
        if len(self._checks) < 3:
            return []
        l2, l1, l0 = self._checks
        curvature = l0 - 2 * l1 + l2
        metrics["loss/curvature"] = curvature
        if curvature > self.curvature_threshold and l0 > l1:
            self._curv_streak += 1
        else:
            self._curv_streak = 0
        if self._curv_streak >= self.curvature_patience:
            self._curv_streak = 0
            return self._alert(
                step,
                "loss_curvature",
                curvature,
                self.curvature_threshold,
                "warning",
                f"loss rising and accelerating: second difference > {self.curvature_threshold:g} for "
                f"{self.curvature_patience} consecutive checks (LR too high or noisy data?)",
            )
        return []

    def observe_eval(self, step: int, eval_loss: float) -> list[dict]:
        """Feed one evaluation's loss; returns the plateau event when the eval loss stopped moving."""
        if not math.isfinite(eval_loss):
            return []
        self._evals.append((step, eval_loss))
        self._evals = [(s, v) for s, v in self._evals if s >= step - self.plateau_window]
        if len(self._evals) < 2 or self._evals[0][0] > step - self.plateau_window or self._plateau_fired:
            return []
        values = [v for _, v in self._evals]
        spread = max(values) - min(values)
        self.record({"loss/eval_spread": spread})
        if spread >= self.plateau_delta:
            return []
        self._plateau_fired = True
        action = "; stopping training (plateau_early_stop)" if self.plateau_early_stop else ""
        return [
            self.event(
                step,
                "loss_plateau",
                f"eval loss moved {spread:.2g} < {self.plateau_delta:g} over the last "
                f"{self.plateau_window} steps{action}",
                value=spread,
                threshold=self.plateau_delta,
                severity="info",
            )
        ]

    def _alert(self, step, kind, value, threshold, severity, message, **extra) -> list[dict]:
        suppressed = self._gate.allow(step, kind)
        if suppressed is None:
            return []
        if suppressed:
            message += f" ({suppressed} similar alerts suppressed since the last one)"
        return [self.event(step, kind, message, value=value, threshold=threshold, severity=severity, **extra)]

    # --- Trainer hooks ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        self._use_step_tap(model if self.enabled else None)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.enabled or model is None:
            return
        stats = GradStats.shared(model)
        read = lambda: self._read(stats, model, args, state)
        if not stats.readers.defer(state.global_step, read):  # else: at the skip guard's gather (`step_readers`)
            read()

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            GradStats.shared(model).readers.flush(state.global_step)  # a deferred read no gather ran (rank-agreed)

    def _read(self, stats: GradStats, model, args, state) -> None:
        # the loss rides in the step's gathered rows: read from them when gathered (no gradient to check for it)
        extras = stats.agreed_extras(state.global_step)
        if extras is None:
            extras = stats.compute(model, step=state.global_step).extras
        den = extras.get("loss_den", 0.0)
        self._from_tap = bool(den)
        if den:
            step = state.global_step + 1
            self.observe_loss(step, extras["loss_num"] / den, metrics_due=logs_at(args, step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.enabled and not self._from_tap and logs and "loss" in logs and "eval_loss" not in logs:
            self.observe_loss(state.global_step, float(logs["loss"]))
        super().on_log(args, state, control, logs=logs, **kwargs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not self.enabled or not metrics or "eval_loss" not in metrics:
            return
        if self.observe_eval(state.global_step, float(metrics["eval_loss"])) and self.plateau_early_stop:
            control.should_training_stop = True
