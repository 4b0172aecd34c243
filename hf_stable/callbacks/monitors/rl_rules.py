"""`RLRules`: what an online-RL run's own signals say is going wrong (GRPO / RLOO, read by `PostTrainMonitor`).

Each rule compares the run's level now - the median of its last `RECENT` values - with its early level - the
median of its first `EARLY` values - and needs both a relative and an absolute margin, so a run's own noise (and the
tiny levels of a short run) stays silent. A rule speaks once per stretch and re-arms when its signal is back in
range. The values are TRL's (``_metrics``: gathered over ranks before TRL took the ``.item()``): the same on every
rank, so the events agree without a collective.

* ``entropy_collapse``: the policy's token entropy fell to `collapse_frac` of its early level (and by at least
  `entropy_floor` nats): the policy is becoming deterministic, exploration stops and rewards plateau.
* ``entropy_blowup``: the entropy rose to `blowup_ratio` x its early level (and by `blowup_floor` nats): the policy
  is turning towards uniform noise (a too-high LR, a damaged update).
* ``kl_blowup``: the KL to the reference is above `kl_max` and `kl_ratio` x its early level.
* ``length_runaway``: the mean completion length grew to `length_ratio` x its early level (and by `length_floor`
  tokens) while the reward did not rise (its level now at most its early level + 5 % of its size): longer answers
  that earn more are what reasoning RL is for, longer answers that earn nothing are padding.
* ``completions_truncated``: TRL's ``completions/clipped_ratio`` (completions cut at ``max_completion_length``)
  reached `truncated_frac`, at least `truncated_rise` above its early level (a run truncated from its first step
  is its own level, not an event).
* ``importance_ratio_tail``: TRL's ``sampling/importance_sampling_ratio/max`` (vLLM's sampler against the trainer)
  above `ratio_max` and `ratio_rise` x its early level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_stable.core.step_noise import median

EARLY = 5  # values that make a signal's early level
RECENT = 5  # values whose median is its level now


@dataclass
class _Rule:
    kind: str
    key: str  # TRL's metric key
    test: str  # "low" (below the early level) or "high"
    what: str
    fix: str


RULES = (
    _Rule(
        "entropy_collapse",
        "entropy",
        "low",
        "the policy's token entropy collapsed",
        "the policy is becoming deterministic and stops exploring: raise the sampling temperature, lower the LR, "
        "add an entropy bonus or a KL penalty (beta > 0), or stop at the last good checkpoint",
    ),
    _Rule(
        "entropy_blowup",
        "entropy",
        "high",
        "the policy's token entropy blew up",
        "the policy is drifting towards noise: lower the LR, check the reward for exploitable noise, and restart "
        "from the last good checkpoint",
    ),
    _Rule(
        "kl_blowup",
        "kl",
        "high",
        "the KL to the reference model blew up",
        "the policy has left the reference far behind: raise beta, lower the LR or the number of iterations per "
        "batch (num_iterations), and check the reward for hacking (read the rollouts)",
    ),
    _Rule(
        "length_runaway",
        "completions/mean_length",
        "high",
        "the completions' mean length ran away",
        "the policy pads its answers (a reward that pays for length?): add a length penalty, cap "
        "max_completion_length, or use a length-normalised loss (loss_type='dr_grpo')",
    ),
    _Rule(
        "completions_truncated",
        "completions/clipped_ratio",
        "high",
        "completions are truncated en masse at max_completion_length",
        "truncated completions are scored unfinished: raise max_completion_length, or set mask_truncated_completions "
        "so they do not teach",
    ),
    _Rule(
        "importance_ratio_tail",
        "sampling/importance_sampling_ratio/max",
        "high",
        "the importance ratio between the sampler and the trainer has a heavy tail",
        "the sampler (vLLM) and the trained policy disagree: check that they share weights, dtype and logprob mode, "
        "keep vllm_importance_sampling_correction on with a cap, or sync weights more often",
    ),
)


class RLRules:
    """The rules above over the values TRL appended each step (see the module docstring); defaults: collapse to
    0.3 x (and 0.2 nats), blow-up to 2 x (and 1 nat), KL > 1.0 and 10 x, length 2 x (and 16 tokens) with a flat
    reward, truncated >= 0.5 (0.3 above the early level), importance ratio > 100 and 10 x."""

    def __init__(
        self,
        collapse_frac: float = 0.3,
        blowup_ratio: float = 2.0,
        entropy_floor: float = 0.2,
        blowup_floor: float = 1.0,
        kl_max: float = 1.0,
        kl_ratio: float = 10.0,
        length_ratio: float = 2.0,
        length_floor: float = 16.0,
        truncated_frac: float = 0.5,
        truncated_rise: float = 0.3,
        ratio_max: float = 100.0,
        ratio_rise: float = 10.0,
    ):
        self.collapse_frac, self.entropy_floor = collapse_frac, entropy_floor
        self.blowup_ratio, self.blowup_floor = blowup_ratio, blowup_floor
        self.kl_max, self.kl_ratio = kl_max, kl_ratio
        self.length_ratio, self.length_floor = length_ratio, length_floor
        self.truncated_frac, self.truncated_rise = truncated_frac, truncated_rise
        self.ratio_max, self.ratio_rise = ratio_max, ratio_rise
        self.series: dict[str, dict] = {}  # key -> {"early": [...], "recent": [...]}
        self.said: set[str] = set()

    def state_dict(self) -> dict:
        return {
            "series": {k: {n: list(v) for n, v in s.items()} for k, s in self.series.items()},
            "said": sorted(self.said),
        }

    def load_state_dict(self, state: dict) -> None:
        self.series = {k: {n: list(v) for n, v in s.items()} for k, s in state.get("series", {}).items()}
        self.said = set(state.get("said", []))

    def _bar(self, kind: str, early: float) -> tuple[bool, float]:
        """(whether `now` must be below the bar, the bar) of rule `kind` against the `early` level."""
        if kind == "entropy_collapse":
            return True, min(early * self.collapse_frac, early - self.entropy_floor)
        if kind == "entropy_blowup":
            return False, max(early * self.blowup_ratio, early + self.blowup_floor)
        if kind == "kl_blowup":
            return False, max(self.kl_max, early * self.kl_ratio)
        if kind == "length_runaway":
            return False, max(early * self.length_ratio, early + self.length_floor)
        if kind == "completions_truncated":
            return False, max(self.truncated_frac, early + self.truncated_rise)
        return False, max(self.ratio_max, early * self.ratio_rise)

    def _reward_rose(self) -> bool:
        s = self.series.get("reward")
        if s is None or len(s["early"]) < EARLY or len(s["recent"]) < RECENT:
            return False
        early = median(s["early"])
        return median(s["recent"]) > early + 0.05 * abs(early)

    def observe(self, values: dict[str, float]) -> list[dict]:
        """Feed one step's values (key -> the step's mean; keys absent this step are left alone). Returns the rules
        that fire now: dicts with ``kind``, ``key``, ``early``, ``now``, ``bar`` and a ``message``."""
        for key, v in values.items():
            if (key == "reward" or any(r.key == key for r in RULES)) and v is not None and math.isfinite(v):
                s = self.series.setdefault(key, {"early": [], "recent": []})
                if len(s["early"]) < EARLY:
                    s["early"].append(v)
                s["recent"] = (s["recent"] + [v])[-RECENT:]
        fired = []
        for rule in RULES:
            s = self.series.get(rule.key)
            if rule.key not in values or s is None or len(s["early"]) < EARLY or len(s["recent"]) < RECENT:
                continue
            early, now = median(s["early"]), median(s["recent"])
            below, bar = self._bar(rule.kind, early)
            bad = now < bar if below else now > bar
            if bad and rule.kind == "length_runaway":  # padding only while the reward does not rise with it
                bad = not self._reward_rose()
            if not bad:
                self.said.discard(rule.kind)
                continue
            if rule.kind in self.said:
                continue
            self.said.add(rule.kind)
            side = "below" if below else "above"
            message = (
                f"{rule.what}: {rule.key} {now:.4g} (median of the last {RECENT}) against its early level {early:.4g} "
                f"(median of the first {EARLY}), {side} the bar {bar:.4g}. What to do: {rule.fix}"
            )
            fired.append(
                {"kind": rule.kind, "key": rule.key, "early": early, "now": now, "bar": bar, "message": message}
            )
        return fired
