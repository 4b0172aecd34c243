"""`PostTrainMonitor`: the signals a TRL trainer already computed, logged beside the gradient health and judged.

TRL's DPO / KTO / GRPO / RLOO trainers compute the numbers that say a preference or RL run is going wrong (reward
and its spread, KL, entropy, clip ratios, chosen / rejected log-probs, margins) and only log them. This callback reads
them before the optimizer step through the trainer family's `SignalReader` (`integrations.trl_signals`: what TRL
appended since the last step, floats it already took off the device; no forward, no host sync) and

* logs every one as ``posttrain/<TRL's key>`` (``posttrain/reward``, ``posttrain/kl``, ``posttrain/rewards/margins``
  ...) in the step's log line, next to ``grad/*``;
* names a reward function that returned ``inf`` (or NaN for completions no other function scored): TRL turns the
  resulting NaN advantages into 0, so those completions teach nothing and nothing else says so
  (`reward_nonfinite`, a warning; the step's gradient stays finite and is applied, a non-finite gradient is skipped
  on every rank by `SkipGuard` as any other); the affected groups' prompts, completions and rewards go to
  ``posttrain_rollouts/step-<N>.jsonl`` (capped), named in the event;
* says when there is no learning signal: TRL's ``frac_reward_zero_std`` (the share of groups whose completions all
  got the same reward, hence advantage 0) at or above `zero_std_frac` for `zero_std_batches` generation batches in a
  row covering at least `zero_std_groups` groups (`no_learning_signal`, one warning per stretch, with what to change).
  A sparse reward that still learns now and then breaks the stretch: on the tiny test policy a 0/1 reward had at
  most 9 all-zero groups in a row;
* judges a DPO / KTO run's chosen log-probs, margins and reward accuracy against its own first window
  (`PreferenceRules`: `likelihood_displacement`, `margin_runaway`, with what to change).

Every rank reads the same numbers (TRL gathers them before logging), so the events agree without a collective.
`hf_stable.stabilize(trainer)` adds and binds it for the trainers whose family reads signals (`trainer_families`).
"""

from __future__ import annotations

import json
import math
import weakref
from pathlib import Path

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.monitors.preference_rules import PreferenceRules
from hf_stable.callbacks.monitors.rl_rules import RLRules
from hf_stable.integrations.trl_signals import GenerationBatch, current_batch, nonfinite_counts, rollout_rows

NAMESPACE = "posttrain/"
ROLLOUT_DIR = "posttrain_rollouts"  # one JSONL per event: step-<N>-<event>.jsonl
ROLLOUT_CAP = 64  # rows per file: the affected groups, not the whole batch


class PostTrainMonitor(StabilityCallback):
    """Reads, logs and judges a TRL trainer's own step signals (see the module docstring).

    Args:
        enabled: when False the callback does nothing.
        zero_std_frac: ``frac_reward_zero_std`` at or above this counts as a batch without learning signal.
        zero_std_batches: generation batches in a row (at least) before `no_learning_signal` is said.
        zero_std_groups: groups in those batches (at least) before it is said.

    Example:
        >>> monitor = PostTrainMonitor()
        >>> monitor.bind(trainer)  # `hf_stable.stabilize(trainer)` does both
    """

    def __init__(
        self, enabled: bool = True, zero_std_frac: float = 0.95, zero_std_batches: int = 3, zero_std_groups: int = 32
    ):
        super().__init__(enabled)
        self.zero_std_frac = zero_std_frac
        self.zero_std_batches = zero_std_batches
        self.zero_std_groups = zero_std_groups
        self._reader = None
        self._trainer_ref = None  # a generating trainer (GRPO, RLOO): its latest batch goes with a skipped step
        self.rl_rules: RLRules | None = None  # entropy, KL, length, truncation, ratio tail (GRPO, RLOO: `bind`)
        self._trainer_name = "the trainer"
        self._hints: dict[str, object] = {}
        self._zero = {"batches": 0, "groups": 0, "said": False, "fracs": []}
        self._nonfinite_seen: dict[str, int] = {}  # "<kind>:<function>" -> generation batches with it
        self._since_log: dict[str, list[float]] = {}  # key -> [sum, count] of the values since the last log line
        self.preference = PreferenceRules()  # DPO / KTO margins and log-probs against the run's own level

    def bind(self, trainer, family) -> None:
        """Read `trainer`'s signals as its `family` says (`TrainerFamily.signal_reader`)."""
        from hf_stable.integrations.trainer_families import trainer_name

        self._reader = family.signal_reader(trainer)
        self._trainer_ref = weakref.ref(trainer) if family.signals == "generation" else None
        self.rl_rules = RLRules() if family.signals == "generation" and self.rl_rules is None else self.rl_rules
        self._trainer_name = trainer_name(trainer)
        self._hints = {
            "num_generations": getattr(trainer, "num_generations", None),
            "temperature": getattr(trainer.args, "temperature", None),
        }
        self.preference.hints = {
            "learning_rate": trainer.args.learning_rate,
            "beta": getattr(trainer.args, "beta", None),
        }

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "zero": dict(self._zero),
            "nonfinite_seen": dict(self._nonfinite_seen),
            "rl_rules": self.rl_rules.state_dict() if self.rl_rules is not None else None,
            "preference": self.preference.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._zero.update(state.get("zero", {}))
        self._nonfinite_seen = dict(state.get("nonfinite_seen", {}))
        if self.rl_rules is not None and state.get("rl_rules"):
            self.rl_rules.load_state_dict(state["rl_rules"])
        self.preference.load_state_dict(state.get("preference", {}))

    # --- decisions (pure: testable on constructed batches) -------------------------------------
    def observe_batch(self, step: int, batch: GenerationBatch) -> list[dict]:
        """Judge one generation batch; returns the events it wrote."""
        events = []
        size = max((len(v) for v in batch.rewards.values()), default=0)
        to_say = []
        for name, counts in nonfinite_counts(batch).items():
            for kind, n in counts.items():
                if n:
                    key = f"{kind}:{name}"
                    seen = self._nonfinite_seen[key] = self._nonfinite_seen.get(key, 0) + 1
                    if not seen & (seen - 1):  # said at the 1st, 2nd, 4th, 8th ... batch with it: never silent,
                        to_say.append((name, kind, n, seen))  # never a flood (nor a flood of rollout files)
        rollouts = self._write_rollouts(step, batch, "reward_nonfinite") if to_say else None
        for name, kind, n, seen in to_say:
            events += self._nonfinite(step, name, kind, n, seen, size, batch.num_generations, rollouts)
        if batch.frac_zero_std is not None:
            events += self._zero_std(step, batch)
        return events

    def _write_rollouts(self, step: int, batch: GenerationBatch | None, event: str, every_group=False) -> str | None:
        """``<output_dir>/posttrain_rollouts/step-<step>-<event>.jsonl``: the prompts, completions, rewards and
        advantages of the groups with a non-finite reward (`every_group`: of the whole batch; main process; at most
        `ROLLOUT_CAP` rows), so the user sees what was scored. Returns the path relative to the output dir (None
        when nothing was written)."""
        rows = rollout_rows(batch, cap=ROLLOUT_CAP, every_group=every_group) if batch is not None else []
        if not rows or self._output_dir is None:
            return None
        rel = f"{ROLLOUT_DIR}/step-{step}-{event}.jsonl"
        if self._is_main:
            path = Path(self._output_dir) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        return rel

    def _nonfinite(
        self, step: int, name: str, kind: str, n: int, seen: int, size: int, k: int, rollouts: str | None
    ) -> list[dict]:
        what = "inf" if kind == "inf" else "NaN (or None) for completions no other reward function scored"
        effect = (
            "TRL's group mean and std become inf/NaN, and it sets the advantages of every completion in the affected "
            f"groups of {k} (the whole batch with scale_rewards='batch') to 0 (nan_to_num)"
            if kind == "inf"
            else "TRL leaves them out of the group baseline and sets their advantages to 0"
        )
        again = f" (generation batch {seen} with this so far)" if seen > 1 else ""
        message = (
            f"step {step}: reward function '{name}' returned {what} for {n} of {size} completions{again}: {effect}, "
            "so they teach nothing this step. The step is applied (its gradient is finite; a non-finite gradient "
            "would be skipped on every rank). Fix the reward function: return a finite number, or None only for a "
            "completion it does not apply to"
            + (f"; the affected groups' prompts, completions and rewards: {rollouts}" if rollouts else "")
        )
        return [
            self.event(
                step,
                "reward_nonfinite",
                message,
                reward_function=name,
                completions=n,
                of=size,
                nonfinite=kind,
                rollouts=rollouts,
                severity="warning",
            )
        ]

    def _zero_std(self, step: int, batch: GenerationBatch) -> list[dict]:
        zero = self._zero
        if batch.frac_zero_std < self.zero_std_frac:
            zero.update(batches=0, groups=0, said=False, fracs=[])
            return []
        zero["batches"] += 1
        zero["groups"] += batch.groups
        zero["fracs"] = (zero["fracs"] + [round(batch.frac_zero_std, 3)])[-8:]
        if zero["said"] or zero["batches"] < self.zero_std_batches or zero["groups"] < self.zero_std_groups:
            return []
        zero["said"] = True
        k, temp = self._hints.get("num_generations"), self._hints.get("temperature")
        message = (
            f"step {step}: no learning signal - in the last {zero['batches']} generation batches ({zero['groups']} "
            f"groups of {batch.num_generations} completions) at least {self.zero_std_frac:.0%} of the groups gave "
            f"every completion the same reward (frac_reward_zero_std, latest: {zero['fracs']}): their advantages "
            f"are 0 and the policy learns nothing from them. Change: more generations per prompt "
            f"(num_generations={k}), a denser reward (partial credit instead of all-or-nothing), or a higher "
            f"sampling temperature (temperature={temp}); easier prompts help a policy that never succeeds"
        )
        return [
            self.event(
                step,
                "no_learning_signal",
                message,
                value=batch.frac_zero_std,
                threshold=self.zero_std_frac,
                batches=zero["batches"],
                groups=zero["groups"],
                severity="warning",
            )
        ]

    def _judge_rl(self, step: int, values: dict[str, list[float]]) -> list[dict]:
        """`RLRules` over this step's means; each event carries the numbers compared and the current generation
        batch's rollouts (``posttrain_rollouts/step-<N>-<event>.jsonl``)."""
        means = {k: sum(v) / len(v) for k, v in values.items() if v}
        events = []
        for hit in self.rl_rules.observe(means):
            trainer = self._trainer_ref() if self._trainer_ref is not None else None
            batch = current_batch(trainer) if trainer is not None else None
            rel = self._write_rollouts(step, batch, hit["kind"], every_group=True)
            message = f"step {step}: {hit['message']}" + (f"; rollouts: {rel}" if rel else "")
            fields = {"key": hit["key"], "early": hit["early"], "threshold": hit["bar"]}
            events.append(
                self.event(step, hit["kind"], message, value=hit["now"], rollouts=rel, severity="warning", **fields)
            )
        return events

    def skipped_rollouts(self, step: int, reasons: list[str]) -> dict:
        """`SkipGuard.skip_detail`: the prompts, completions, rewards and advantages of the generation batch a
        skipped GRPO / RLOO step trained on, to ``posttrain_rollouts/step-<N>-step_skipped.jsonl``; the skip event's
        field ``rollouts`` (empty for a trainer that does not generate)."""
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if not self.enabled or trainer is None:
            return {}
        rel = self._write_rollouts(step, current_batch(trainer), "step_skipped", every_group=True)
        return {"rollouts": rel} if rel else {}

    # --- Trainer hooks ---------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        self._since_log = {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.enabled or self._reader is None:
            return
        step = state.global_step + 1
        signals = self._reader.read()
        for key, vals in signals.values.items():
            acc = self._since_log.setdefault(key, [0.0, 0])
            for v in vals:
                if not math.isnan(v):  # as TRL's own log(): a NaN batch is no value
                    acc[0] += v
                    acc[1] += 1
        # the mean since the last log line, as TRL averages its own (logging_steps > 1 included)
        self.record({NAMESPACE + key: s / n for key, (s, n) in self._since_log.items() if n})
        for batch in signals.batches:
            self.observe_batch(step, batch)
        if self.rl_rules is not None:
            self._judge_rl(step, signals.values)
        for kind, message, fields in self.preference.observe(step, signals.values):
            self.event(step, kind, message, severity="warning", **fields)
