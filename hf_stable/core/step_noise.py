"""The run's own noise, as the skip guard measures it: robust statistics of the recent accepted steps' losses and
gradient norms, in log (losses and norms spread multiplicatively: a hard record is 2-3x the median, not +1)."""

from __future__ import annotations

import itertools
import math
from collections import deque

from hf_stable.core.monitor_utils import robust_zscore


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def robust_scale(xs: list[float]) -> float:
    """1.4826 x the median absolute deviation: the standard deviation of a normal sample, unmoved by outliers."""
    med = median(xs)
    return 1.4826 * median([abs(x - med) for x in xs])


class LogWindow(deque):
    """A bounded window of floats (a `deque` with `maxlen`) that takes each value's log once, as it arrives.

    The guards and monitors judge a step against the logs of their window; recomputing every log at every step cost
    more than the rest of the rule. `logs_of(window)` gives the same floats as logs taken on demand. Only `append`,
    `extend` and `clear` change a window (anything else raises): a window is replaced, not edited.
    """

    def __init__(self, values=(), maxlen: int | None = None):
        super().__init__(values, maxlen)
        self._logs: deque = deque((math.log(x) if x > 0 else None for x in self), maxlen=maxlen)
        self._bad = sum(1 for x in self if not x > 0)  # values <= 0 (or NaN): the window has no logs

    def append(self, x) -> None:
        if self.maxlen == 0:
            return
        if len(self) == self.maxlen and not self[0] > 0:
            self._bad -= 1  # the oldest value falls out
        super().append(x)
        if x > 0:
            self._logs.append(math.log(x))
        else:
            self._logs.append(None)
            self._bad += 1

    def clear(self) -> None:
        super().clear()
        self._logs.clear()
        self._bad = 0

    def extend(self, values) -> None:
        for x in values:
            self.append(x)

    def logs(self) -> list[float] | None:
        return None if self._bad else list(self._logs)

    @property
    def positive(self) -> bool:
        """Every value is > 0 (the window has logs)."""
        return not self._bad

    def __reduce__(self):  # copies and pickles are rebuilt from the values (their logs taken afresh)
        return type(self), (list(self), self.maxlen)

    def __copy__(self):
        return type(self)(self, self.maxlen)

    def _edit(self, *args, **kwargs):
        raise TypeError("a LogWindow changes only by append(), extend() and clear(): build a new one instead")

    appendleft = extendleft = insert = pop = popleft = remove = reverse = rotate = _edit
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _edit


def logs_of(xs) -> list[float] | None:
    """The logs of a positive history (None when some value is <= 0: a custom loss)."""
    if isinstance(xs, LogWindow):
        return xs.logs()
    xs = list(xs)
    return [math.log(x) for x in xs] if all(x > 0 for x in xs) else None


def log_z(value: float, history, scale: float | None = None) -> float | None:
    """(log(value) - the median log of the history) / `scale`, by default the history's robust scale; None without
    >= 3 positive values. The skip guard passes the step-to-step noise: a trend in the window (the fast descent of
    a run's first steps) is not noise, and a spread inflated by it would hide a garbage batch."""
    logs = logs_of(history)
    if logs is None or len(logs) < 3 or value <= 0:
        return None
    if not scale:
        return robust_zscore(math.log(value), logs)
    return (math.log(value) - median(logs)) / scale


def window_noise(losses, norms) -> dict:
    """The median and robust scale (1.4826 MAD) of the log loss and of the log grad norm over the window, and the
    step-to-step noise of the log loss (from successive differences, so a trend does not count as noise)."""
    logs = logs_of(losses)
    out: dict = {"n": len(losses)}
    if logs is not None and len(logs) >= 3:
        out["loss_median"] = median(list(losses))
        out["loss_log_scale"] = robust_scale(logs)
        if len(logs) >= 4:
            diffs = [b - a for a, b in itertools.pairwise(logs)]
            out["loss_step_noise"] = robust_scale(diffs) / math.sqrt(2.0)
    norm_logs = logs_of(norms)
    if norm_logs is not None and len(norm_logs) >= 3:
        out["grad_log_scale"] = robust_scale(norm_logs)
    return out


def explain(reasons: list[str], ev: dict, cfg) -> str:
    """The numbers a finite-step rule compared, for the event message (the noise it measured against)."""
    n = ev.get("window_steps")
    parts = []
    if "loss_spike" in reasons and "loss_z" in ev:
        parts.append(
            f"log loss {ev['loss_z']:.3g} sd of the step noise above the median {ev.get('loss_median', math.nan):.4g} "
            f"(> {cfg.loss_spike_zscore:g}; step noise {ev.get('loss_step_noise', math.nan):.3g} over {n} steps)"
        )
    if "grad_spike" in reasons and "grad_z" in ev:
        parts.append(
            f"log grad norm {ev['grad_z']:.3g} robust sd above its median (> {cfg.grad_spike_zscore:g}; sd "
            f"{ev.get('grad_log_scale', math.nan):.3g} over {n} steps)"
        )
    if "loss_rise" in reasons and "rise_log" in ev:
        sigma = ev.get("rise_sigma")
        noise = f", {ev['rise_log'] / sigma:.3g} sd of its noise {sigma:.3g}" if sigma else ""
        parts.append(f"loss trend x{math.exp(ev['rise_log']):.3g} the recent best{noise}")
    if "damaged" in reasons and "ratio_tail" in ev:
        parts.append(
            f"damaged RL inputs: {ev['nonfinite_logps']:.0f} non-finite old/sampling log-probs, "
            f"{ev['ratio_tail']:.0f} importance ratios above 1000 (largest {ev.get('ratio_max', math.nan):.4g})"
        )
    return f" - {'; '.join(parts)}" if parts else ""
