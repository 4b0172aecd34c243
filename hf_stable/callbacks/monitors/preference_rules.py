"""`PreferenceRules`: what a DPO / KTO run's own margins and log-probs say, judged against the run's own level.

`PostTrainMonitor` hands it, every optimizer step, the values TRL appended for the step (``logps/chosen``,
``logps/rejected``, ``rewards/margins``, ``rewards/accuracies``); each key's step value is the mean over the step's
micro-batches. Windows of `window` steps are compared with medians (one odd batch, e.g. a skipped swapped pair, does
not move them):

* ``likelihood_displacement`` (warning): the chosen completions' log-probability, median of the last window, is
  below its level in the run's first window by more than `fall_z` times that window's noise (1.4826 x MAD) and by
  more than `fall_rel` of the level, while the margin's median grew by more than `fall_z` times its own first-window
  noise. The policy wins the preference by pushing both completions down (TRL issue 800): the chosen answers get
  less likely, probability goes to sequences that are neither.
* ``margin_runaway`` (warning): reward accuracy at or above `accuracy_min` in every step of the last two windows
  (nothing left to separate) while the margin's median grew `margin_ratio` times from the earlier window to the last
  one. The loss is near 0 and the implicit rewards keep growing: the policy drifts from the reference for nothing.

On a healthy run the chosen log-probs stay level or rise and the margin grows steadily (x1.3 - x2.2 a window of 16
on the tiny test policy with accuracy 1); each event is said once per stretch and again only after it cleared.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

CHOSEN, REJECTED, MARGIN, ACCURACY = "logps/chosen", "logps/rejected", "rewards/margins", "rewards/accuracies"
KEYS = (CHOSEN, REJECTED, MARGIN, ACCURACY)


def _noise(values: list[float]) -> float:
    """A robust step-to-step spread: 1.4826 x the median absolute deviation."""
    med = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - med) for v in values)


class PreferenceRules:
    """Judges a preference run's per-step signals (see the module docstring).

    Args:
        window: steps per window (the first window is the run's reference level).
        fall_z: how many first-window noises the chosen log-prob must fall (and the margin grow).
        fall_rel: the least fall of the chosen log-prob, as a fraction of its reference level.
        accuracy_min: reward accuracy at or above this counts as stuck at 1.
        margin_ratio: margin growth from one window to the next that counts as a runaway.

    Example:
        >>> rules = PreferenceRules()
        >>> for step, values in enumerate(per_step_values, 1):
        ...     for kind, message, fields in rules.observe(step, values):
        ...         print(kind, message)
    """

    def __init__(
        self,
        window: int = 16,
        fall_z: float = 4.0,
        fall_rel: float = 0.1,
        accuracy_min: float = 0.99,
        margin_ratio: float = 4.0,
    ):
        self.window, self.fall_z, self.fall_rel = window, fall_z, fall_rel
        self.accuracy_min, self.margin_ratio = accuracy_min, margin_ratio
        self.hints: dict[str, object] = {}
        self._first: dict[str, list[float]] = {k: [] for k in KEYS}  # the reference window
        self._recent: dict[str, deque] = {k: deque(maxlen=2 * window) for k in KEYS}
        self._said: dict[str, bool] = {"likelihood_displacement": False, "margin_runaway": False}

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"first": self._first, "recent": {k: list(v) for k, v in self._recent.items()}, "said": self._said}

    def load_state_dict(self, state: dict) -> None:
        for k in KEYS:
            self._first[k] = [float(v) for v in state.get("first", {}).get(k, [])]
            self._recent[k] = deque((float(v) for v in state.get("recent", {}).get(k, [])), maxlen=2 * self.window)
        self._said.update(state.get("said", {}))

    # --- decisions -------------------------------------------------------------------------------
    def observe(self, step: int, values: dict[str, list[float]]) -> list[tuple[str, str, dict]]:
        """One optimizer step's values (key -> what TRL appended); returns ``(kind, message, fields)`` to say."""
        for key in KEYS:
            vals = [v for v in values.get(key, ()) if math.isfinite(v)]
            if not vals:
                continue
            v = sum(vals) / len(vals)
            if len(self._first[key]) < self.window:
                self._first[key].append(v)
            self._recent[key].append(v)
        out = []
        for kind, judge in (("likelihood_displacement", self._displacement), ("margin_runaway", self._runaway)):
            found = judge(step)
            if found is None:
                self._said[kind] = False  # cleared: a new stretch is said again
            elif not self._said[kind]:
                self._said[kind] = True
                out.append((kind, *found))
        return out

    def _last(self, key: str) -> list[float]:
        return list(self._recent[key])[-self.window :]

    def _ready(self, *keys: str) -> bool:
        return all(len(self._first[k]) >= self.window and len(self._recent[k]) >= 2 * self.window for k in keys)

    def _displacement(self, step: int):
        if not self._ready(CHOSEN, MARGIN):
            return None
        ref, cur = statistics.median(self._first[CHOSEN]), statistics.median(self._last(CHOSEN))
        m_ref, m_cur = statistics.median(self._first[MARGIN]), statistics.median(self._last(MARGIN))
        noise, m_noise = _noise(self._first[CHOSEN]), _noise(self._first[MARGIN])
        fall = ref - cur
        if not (
            fall > self.fall_z * noise and fall > self.fall_rel * abs(ref) and m_cur - m_ref > self.fall_z * m_noise
        ):
            return None
        rejected = ""
        if self._ready(REJECTED):
            r_ref, r_cur = statistics.median(self._first[REJECTED]), statistics.median(self._last(REJECTED))
            rejected = f"; rejected: {r_ref:.2f} -> {r_cur:.2f}"
        w = self.window
        message = (
            f"step {step}: likelihood displacement - the chosen completions' log-probability fell from {ref:.2f} "
            f"(median of the first {w} steps) to {cur:.2f} (the last {w}), {fall:.2f} lower ({fall / abs(ref):.0%} of "
            f"its level, {fall / max(noise, 1e-12):.1f}x the first window's noise {noise:.3f}), while the margin grew "
            f"from {m_ref:.3f} to {m_cur:.3f}{rejected}: the policy wins the preference by making both completions "
            "less likely, so the chosen answers lose probability to sequences that are neither. "
            f"Lower the learning rate (learning_rate={self.hints.get('learning_rate')}) or raise beta "
            f"(beta={self.hints.get('beta')}), or add an SFT term on the chosen completions: "
            "DPOConfig(loss_type=['sigmoid', 'sft'])"
        )
        fields = {"value": cur, "reference": ref, "fall": fall, "noise": noise, "margin": m_cur, "margin_ref": m_ref}
        return message, fields

    def _runaway(self, step: int):
        if not self._ready(MARGIN, ACCURACY):
            return None
        accs = list(self._recent[ACCURACY])
        if min(accs) < self.accuracy_min:
            return None
        before = statistics.median(list(self._recent[MARGIN])[: self.window])
        cur = statistics.median(self._last(MARGIN))
        if not (before > 0 and cur > self.margin_ratio * before):
            return None
        w = self.window
        message = (
            f"step {step}: margin runaway - reward accuracy has been at least {self.accuracy_min:g} on every one of "
            f"the last {2 * w} steps (nothing left to separate) while the margin grew {cur / before:.1f}x in {w} "
            f"steps (median {before:.3f} -> {cur:.3f}; a healthy run here grows it steadily, the threshold is "
            f"{self.margin_ratio:g}x): the loss is near 0 and the policy keeps moving away from the reference for "
            f"nothing. Lower the learning rate (learning_rate={self.hints.get('learning_rate')}) or raise beta "
            f"(beta={self.hints.get('beta')}), stop earlier, or add an SFT term: DPOConfig(loss_type=['sigmoid', "
            "'sft'])"
        )
        return message, {"value": cur, "reference": before, "ratio": cur / before, "accuracy_min": min(accs)}
