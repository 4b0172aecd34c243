"""`SkipRules`: the skip guard's finite rules, measured against the run's own noise (pure host numbers).

The half of `SkipGuard` that judges one step's grad norm and loss against the references it learned from accepted
steps (`core.step_noise`): the grad-norm spike, the loss spike and the loss rise, and whether the run is healthy
enough for a snapshot. The guard's state, learning and decision (and the rank agreement) stay in `skip_guard.py`.
"""

from __future__ import annotations

import math

from hf_stable.core.monitor_utils import robust_zscore
from hf_stable.core.step_noise import log_z, median, window_noise

_RISE_STEPS = 5  # a rise is sustained: the median of this many latest losses is above the bar too
_MIN_HISTORY = 8  # accepted grad norms before their robust scale joins the grad-spike rule
_MID_BETA = 0.9  # the loss-rise reference: the lowest value of this EMA over the window (follows a fast descent)


class SkipRules:
    """Mixin of `SkipGuard`: the rules over its references (`_losses`, `_norms`, `_mid_hist`, `_recent`,
    `_norm_ema`, `_accepted`) and its configuration fields."""

    def noise(self) -> dict:
        """The run's own noise over the window's accepted steps (`core.step_noise.window_noise`)."""
        return window_noise(self._losses, self._norms)

    def _rise_noise(self, noise: dict) -> float | None:
        """Standard deviation of the rise statistic on a flat healthy run: the step noise (from successive
        differences, so neither a trend nor a slow divergence inflates it) through the median of the latest
        `_RISE_STEPS` losses (variance ~ (pi / 2) / k) and the smoothed loss ((1 - b) / (1 + b)). Runs of hard
        batches are what the threshold's margin is for (the clean grid's highest: 4.3 sd at batch 1)."""
        step = noise.get("loss_step_noise")
        if step is None:
            return None
        return step * math.sqrt(math.pi / 2 / _RISE_STEPS + (1 - _MID_BETA) / (1 + _MID_BETA))

    def _rise_stat(self, level: float) -> float | None:
        """log(loss level / the window's lowest smoothed loss), None when not defined (no history, loss <= 0)."""
        ref = min(self._mid_hist) if self._mid_hist else None
        if ref is None or ref <= 0 or level <= 0:
            return None
        return math.log(level / ref)

    def _rising(self, level: float | None, noise, scale: float = 1.0) -> bool:
        """A rise: the loss level `scale` x loss_rise_rel above the reference and `scale` x loss_rise_zscore
        standard deviations of the rise statistic's own noise above its centre. `noise()` gives the window's noise
        (asked for only when the level is above the first bar)."""
        stat = None if level is None else self._rise_stat(level)
        if stat is None or stat <= math.log1p(self.loss_rise_rel * scale):
            return False
        sigma = self._rise_noise(noise())
        return self.loss_rise_zscore is None or sigma is None or stat > scale * self.loss_rise_zscore * sigma

    @property
    def last_evidence(self) -> dict:
        """The statistics the last `local_flags` (and `damage_flag`) compared, for a `step_skipped` event. The window's
        noise in it is measured here, on request: a step that no rule came near needs none of it."""
        finish, self._finish_evidence = self._finish_evidence, None
        if finish is not None:
            finish()
        return {**self._rule_evidence, **self._damage_evidence}

    def local_flags(self, grad_norm: float, loss: float | None, nonfinite_grads: bool = False) -> list[float]:
        """[nonfinite, grad_spike, loss_spike, loss_rise] as 0/1 from this rank's numbers (no state change; the
        statistics compared are left in `last_evidence`)."""
        bad = self.nonfinite and (
            nonfinite_grads or not math.isfinite(grad_norm) or (loss is not None and not math.isfinite(loss))
        )
        self._rule_evidence, self._damage_evidence, self._finish_evidence = {}, {}, None
        if bad:
            return [1.0, 0.0, 0.0, 0.0]
        warm = self._accepted >= self.warmup_steps
        measured: list[dict] = []

        def noise() -> dict:  # the window's noise, measured once and only when a rule needs it
            if not measured:
                measured.append(self.noise() if warm else {})
            return measured[0]

        evidence = self._rule_evidence
        grad_spike = math.isfinite(grad_norm) and self.grad_norm_max is not None and grad_norm > self.grad_norm_max
        if (
            not grad_spike
            and warm
            and math.isfinite(grad_norm)
            and self.grad_spike_ratio is not None
            and self._norm_ema is not None
            and self._norm_ema > 0  # a reference of 0 would call every signal a spike (never learned: `learn`)
            and grad_norm > self.grad_spike_ratio * self._norm_ema
        ):
            # the z needs a history worth a robust scale; before that (a run's first steps, references reset by a
            # rollback to the start) the ratio alone decides, as a divergence there must still be caught
            z = log_z(grad_norm, self._norms) if len(self._norms) >= _MIN_HISTORY else None
            evidence.update({} if z is None else {"grad_z": z})
            grad_spike = self.grad_spike_zscore is None or z is None or z > self.grad_spike_zscore
        loss_spike = False
        if warm and loss is not None and self.loss_spike_zscore is not None and len(self._losses) >= 3:
            mid = median(list(self._losses))
            if loss > mid * (1 + self.loss_spike_min_rel):
                z = log_z(loss, self._losses, scale=noise().get("loss_step_noise"))
                if z is None:  # losses <= 0 (a custom loss): the z-score of the loss itself
                    z = robust_zscore(loss, list(self._losses))
                evidence["loss_z"] = z
                loss_spike = z > self.loss_spike_zscore
        loss_rise = False
        level = None
        rise_judged = (
            warm
            and loss is not None
            and self.loss_rise_rel is not None
            and bool(self._mid_hist)
            and not (loss_spike or grad_spike)
        )  # a spike is judged as a spike, not as a trend
        if rise_judged:
            level = self._level_with(loss)
            loss_rise = self._rising(level, noise)

        def finish() -> None:  # the rest of the evidence, in the order the event has always listed it
            if rise_judged:
                stat, sigma = (None if level is None else self._rise_stat(level)), self._rise_noise(noise())
                evidence.update({k: v for k, v in (("rise_log", stat), ("rise_sigma", sigma)) if v is not None})
            if noise():
                evidence.update({k: v for k, v in noise().items() if k != "n"}, window_steps=noise()["n"])

        flags = [0.0, float(grad_spike), float(loss_spike), float(loss_rise)]
        if any(flags):
            finish()
        else:  # measured only if the step is skipped for another reason (`last_evidence`)
            self._finish_evidence = finish
        return flags

    def damage_flag(self, extras: dict) -> float:
        """1.0 when the step's own RL inputs are damaged (`integrations.rl_damage`: non-finite log-probs, an
        importance-ratio tail; sums over ranks from the gathered rows, so the same on every rank); the numbers join
        `last_evidence`."""
        nonfinite, tail = extras.get("rl_nonfinite_logps", 0.0), extras.get("rl_ratio_tail", 0.0)
        if not self.damage_rules or not (nonfinite > 0 or tail > 0 or math.isnan(nonfinite + tail)):
            return 0.0
        ratio_max = extras.get("rl_ratio_max", math.nan)
        self._damage_evidence = {"nonfinite_logps": nonfinite, "ratio_tail": tail, "ratio_max": ratio_max}
        return 1.0

    def _level_with(self, loss: float | None = None) -> float | None:
        """The loss level now: the median of the latest plausible losses (with `loss`), robust to one hard batch;
        None before there are 3 of them."""
        latest = ([*self._recent, loss] if loss is not None else list(self._recent))[-_RISE_STEPS:]
        return median(latest) if len(latest) >= 3 else None

    @property
    def healthy(self) -> bool:
        """False while the smoothed loss sits well above its reference (half a rise, by both of the rise rule's
        measures: a rise under way): no time for a snapshot."""
        if self.loss_rise_rel is None or not self._mid_hist:
            return True
        return not self._rising(self._level_with(), self.noise, scale=0.5)
