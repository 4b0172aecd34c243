"""What a TRL trainer already computed about its step, read without computing anything again.

TRL's DPO, KTO, GRPO and RLOO trainers append the step's signals (reward and its spread, KL, entropy, clip ratios,
importance-sampling ratios, chosen/rejected log-probs, margins, accuracies ...) as Python floats to
``trainer._metrics[mode][key]`` (TRL took the ``.item()``) and clear that dict in their ``log()``. GRPO and RLOO also
keep the last generation batch's per-function rewards, gathered from every rank, in ``trainer._logs["rewards"]``
(a deque of ``generation_batch_size`` floats per reward function). `SignalReader` hands out what was appended since
its last read: no forward, no tensor, no host sync, and the same numbers on every rank (TRL gathers them).

One place (`trainer_families`): the monitors never look into a trainer; they ask `TrainerFamily.signal_reader`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

_SKIPPED_KEYS = ("num_tokens", "step_time")  # a running count and a timing, not signals of the step


@dataclass
class GenerationBatch:
    """The rewards of one GRPO / RLOO generation batch (every rank's completions, as TRL gathered them).

    Args:
        rewards: reward function name -> one float per completion (NaN where the function returned None or NaN).
        num_generations: completions per prompt (a group).
        frac_zero_std: TRL's ``frac_reward_zero_std`` of this batch (None when the trainer does not log it).
        prompts, completions: the batch's prompts and completions in the rewards' order (TRL's completions table;
            empty when the trainer keeps none).
        advantages: TRL's advantage of each completion, in the same order (empty when not kept).
    """

    rewards: dict[str, list[float]]
    num_generations: int
    frac_zero_std: float | None = None
    prompts: list = field(default_factory=list)
    completions: list = field(default_factory=list)
    advantages: list = field(default_factory=list)
    groups: int = field(init=False)

    def __post_init__(self):
        size = max((len(v) for v in self.rewards.values()), default=0)
        self.groups = size // max(1, self.num_generations)


@dataclass
class Signals:
    """What one read found: ``values`` (key -> the values appended since the last read, in order) and, for an
    online-RL trainer that generated since, the new `GenerationBatch` es (oldest first)."""

    values: dict[str, list[float]]
    batches: list[GenerationBatch]

    def mean(self, key: str) -> float | None:
        vals = self.values.get(key)
        return sum(vals) / len(vals) if vals else None


class SignalReader:
    """Reads the entries a TRL trainer appended to ``_metrics["train"]`` since the last `read` (held weakly).

    Args:
        trainer: the TRL trainer.
        generates: the trainer samples completions and scores them with reward functions (GRPO, RLOO).
    """

    def __init__(self, trainer, generates: bool = False):
        self._trainer = weakref.ref(trainer)
        self.generates = generates
        # key -> (the list read last, entries already read): the list itself, not its id - TRL's log() drops the
        # lists and a new one may be allocated at the same address
        self._seen: dict[str, tuple[list, int]] = {}

    def read(self) -> Signals:
        trainer = self._trainer()
        metrics = getattr(trainer, "_metrics", None) if trainer is not None else None
        train = metrics.get("train") if isinstance(metrics, dict) else None
        values: dict[str, list[float]] = {}
        for key, vals in list((train or {}).items()):
            if key in _SKIPPED_KEYS or not isinstance(vals, list):
                continue
            last, seen = self._seen.get(key, (None, 0))
            if last is not vals or seen > len(vals):  # TRL's log() cleared the dict: a fresh list
                seen = 0
            new = [float(v) for v in vals[seen:] if isinstance(v, int | float)]
            self._seen[key] = (vals, len(vals))
            if new:
                values[key] = new
        batches = self._batches(trainer, values) if self.generates else []
        return Signals(values=values, batches=batches)

    @staticmethod
    def _batches(trainer, values: dict[str, list[float]]) -> list[GenerationBatch]:
        """The newest generation batch (TRL's ``_logs`` keeps only the last one) when the trainer generated since
        the last read; a batch is new when TRL appended its ``reward`` mean."""
        if not values.get("reward"):
            return []
        batch = current_batch(trainer, values.get("frac_reward_zero_std"))
        return [batch] if batch is not None else []


def current_batch(trainer, fracs: list[float] | None = None) -> GenerationBatch | None:
    """The trainer's latest generation batch as TRL keeps it in ``_logs`` (the one the current step trains on when
    each step generates its own), None when it keeps none."""
    logs = getattr(trainer, "_logs", None)
    per_func = logs.get("rewards") if isinstance(logs, dict) else None
    if not per_func:
        return None
    rewards = {name: [float(r) for r in deque_] for name, deque_ in per_func.items()}
    size = max((len(v) for v in rewards.values()), default=0)
    prompts, completions = list(logs.get("prompt") or ()), list(logs.get("completion") or ())
    advantages = [float(a) for a in logs.get("advantages") or ()]
    aligned = len(prompts) == len(completions) == size  # the table holds exactly this batch
    return GenerationBatch(
        rewards=rewards,
        num_generations=int(getattr(trainer, "num_generations", 1) or 1),
        frac_zero_std=fracs[-1] if fracs else None,
        prompts=prompts if aligned else [],
        completions=completions if aligned else [],
        advantages=advantages if aligned and len(advantages) == size else [],
    )


def nonfinite_counts(batch: GenerationBatch) -> dict[str, dict[str, int]]:
    """Per reward function: how many completions it scored ``inf``/``-inf`` (``inf``) and how many it left NaN while
    no other function scored them either (``unscored``: TRL gives those completions advantage 0). A NaN (or None)
    from one function on a completion another function scored is TRL's documented "not applicable" and not counted.
    """
    names = list(batch.rewards)
    size = min((len(v) for v in batch.rewards.values()), default=0)
    unscored = [all(math.isnan(batch.rewards[n][i]) for n in names) for i in range(size)]
    out = {}
    for name in names:
        vals = batch.rewards[name][:size]
        inf = sum(math.isinf(v) for v in vals)
        nan = sum(math.isnan(v) and unscored[i] for i, v in enumerate(vals))
        if inf or nan:
            out[name] = {"inf": inf, "unscored": nan}
    return out


def _safe(v: float):
    return v if math.isfinite(v) else str(v)


def rollout_rows(batch: GenerationBatch, cap: int = 64, every_group: bool = False) -> list[dict]:
    """The groups of `batch` holding a non-finite reward (`every_group`: all groups), one JSON-safe row per
    completion (at most `cap`): its index and group, the prompt, the completion, every function's reward and TRL's
    advantage when kept (``"inf"`` / ``"nan"`` as strings)."""
    if not batch.completions:
        return []
    k = max(1, batch.num_generations)
    groups = sorted(
        {i // k for vals in batch.rewards.values() for i, v in enumerate(vals) if every_group or not math.isfinite(v)}
    )
    rows = []
    for g in groups:
        for i in range(g * k, min((g + 1) * k, len(batch.completions))):
            row = {
                "index": i,
                "group": g,
                "prompt": batch.prompts[i],
                "completion": batch.completions[i],
                "rewards": {n: _safe(v[i]) for n, v in batch.rewards.items()},
            }
            if batch.advantages:
                row["advantage"] = _safe(batch.advantages[i])
            rows.append(row)
            if len(rows) >= cap:
                return rows
    return rows
