"""`SkipGuard`: skip an optimizer step whose gradients or loss are non-finite, or a spike — on every rank together.

Judged in `on_pre_optimizer_step` from the shared `GradStats` report (pre-clip norms; the per-step loss from
`StepTap`), which every rank reads from the same gathered rows - the step's one collective, taken here after every
callback listed before this guard (the monitors' reads wait for it: `core.step_readers`), or taken again here when a
reader listed earlier gathered it - so one rank's NaN skips the step everywhere.
Skipping is `p.grad = None` (the optimizer then leaves the parameter and its state alone; zeroing would not).
The step still counts: `global_step`, the data and the LR schedule advance as usual
(`tests/test_guards_trainer.py` checks the schedule).

Rules: non-finite gradients or loss; gradients that differ between ranks after the all-reduce (`rank_mismatch`);
and three finite rules, each measured against the run's own noise over the last `window` accepted steps, since a
step averages as many records as the batch holds (at batch 1 one record: hard ones sit at 2-3x the median):
* grad-norm spike: > `grad_spike_ratio` x its EMA and `grad_spike_zscore` robust sd above the window's median log norm;
* loss spike: the log loss `loss_spike_zscore` sd of the step noise (1.4826 MAD of successive log-loss differences
  / sqrt 2: a trend is not noise) above the window's median, and `loss_spike_min_rel` above the median loss;
* loss rise (counts towards a rollback): the loss level - the median of the last 5 plausible losses, which one hard
  batch does not move - `loss_rise_rel` above the window's lowest smoothed loss, and `loss_rise_zscore` sd of its
  noise (the step noise through that median and the smoothed loss).
Defaults: 6 sd (OLMo-core's anchor, 6 sigma over 128 steps); over the clean grid of `benchmarks/specificity.py`
(batch 1-16) no step went past 4.9. References learn from accepted steps only; a level that persists
`max_consecutive_skips` steps becomes the new normal. Every `step_skipped` event carries the statistics compared.
A step whose gradient is exactly zero carries no learning signal (e.g. a GRPO step where every group's rewards are
equal, so every advantage is 0): it is applied as a stock run would, judged by the non-finite rule only, and is no
reference (a grad-norm EMA of 0 made every later step a "spike") nor a break in a streak of spike skips (else
zero-signal steps in between kept `max_consecutive_skips` from ever releasing it); one info note says so.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.skip_rules import _MID_BETA, _RISE_STEPS, SkipRules
from hf_stable.config.guards import SkipConfig
from hf_stable.core.grad_stats import GradStats
from hf_stable.core.rank_agreement import GuardOrderError, drop_gradients
from hf_stable.core.step_noise import LogWindow, explain
from hf_stable.core.step_tap import StepTapUser
from hf_stable.distributed import is_distributed

REASONS = ("nonfinite", "grad_spike", "loss_spike", "loss_rise", "rank_mismatch", "damaged")
_HARD = ("nonfinite", "rank_mismatch", "damaged")  # skipped whatever the references say; never a new normal
_KEEP_STEPS = 10_000  # skipped step numbers kept in memory (the count is exact)
_NO_SIGNAL_WARN = 50  # zero-gradient steps in a row that are worth a warning


@dataclass
class StepVerdict:
    """The skip guard's decision for optimizer step `step` (1-based, the step being made)."""

    step: int
    skip: bool
    reasons: list[str] = field(default_factory=list)
    grad_norm: float = math.nan
    loss: float = math.nan


class SkipGuard(SkipRules, StepTapUser, StabilityCallback):
    """Skips bad optimizer steps on every rank together; event `step_skipped`, metrics `guard/skipped*`.

    Args:
        config: a `SkipConfig` (default `SkipConfig()`; every field is documented there and in docs/CONFIG.md).
        **overrides: `SkipConfig` fields to change, e.g. `SkipGuard(loss_spike_zscore=4)`.

    Raises:
        GuardOrderError: from `verdict_for` when a guard that needs the verdict runs before this one.

    Example:
        >>> skip = SkipGuard(grad_spike_ratio=20)
        >>> trainer = Trainer(..., callbacks=[skip, RollbackGuard(skip, LRControl())])
    """

    def __init__(self, config: SkipConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(SkipConfig, config, overrides)
        window = cfg.window
        self._recent: deque[float] = deque(maxlen=_RISE_STEPS)  # the latest plausible losses: the loss level now
        self._loss_mid: float | None = None
        self._mid_hist: deque[float] = deque(maxlen=window)
        self._spike_streak = 0
        self._norm_ema: float | None = None
        self._accepted = 0
        self._losses: LogWindow = LogWindow(maxlen=window)  # (their logs taken once: `core.step_noise`)
        self._norms: LogWindow = LogWindow(maxlen=window)
        self._skipped_total = 0
        self._skipped_steps: deque[int] = deque(maxlen=_KEEP_STEPS)  # bounded: a run may skip for days
        self._off_reason: str | None = None
        self._listeners: list[Callable] = []
        self.last_verdict: StepVerdict | None = None
        # the statistics the last judgement compared (`last_evidence`): the rules', the RL damage check's, and the
        # rest of the rules' (the window's noise), measured when read
        self._rule_evidence: dict = {}
        self._damage_evidence: dict = {}
        self._finish_evidence: Callable[[], None] | None = None
        self._judged: int | None = None  # the step label last read (`judges_later`)
        self._gathers_at_begin: int | None = None  # `GradStats.row_gathers` when the step began
        self._no_signal_total = 0  # steps whose gradient was exactly zero (applied, never a reference)
        self._no_signal_streak = 0  # ... in a row, up to now
        # zero-gradient steps in a row worth a warning; None: another callback says why (`PostTrainMonitor` reads
        # the reward spread of an RL trainer and names the cause and the fix; `hf_stable.stabilize` sets it)
        self.no_signal_warn_steps: int | None = _NO_SIGNAL_WARN
        # fn(step, reasons) -> extra fields of a `step_skipped` event (the rollouts of a GRPO step: `stabilize`)
        self.skip_detail: Callable[[int, list[str]], dict] | None = None

    # --- state ---------------------------------------------------------------------------------------
    def stats_state(self) -> dict:
        """The spike references only (what a rollback restores)."""
        return {
            "norm_ema": self._norm_ema,
            "accepted": self._accepted,
            "losses": list(self._losses),
            "norms": list(self._norms),
            "spike_streak": self._spike_streak,
            "recent": list(self._recent),
            "loss_mid": self._loss_mid,
            "mid_hist": list(self._mid_hist),
        }

    def load_stats_state(self, state: dict) -> None:
        ema = state.get("norm_ema")
        self._norm_ema = None if ema is None else float(ema)
        self._accepted = int(state.get("accepted", 0))
        self._losses = LogWindow((float(x) for x in state.get("losses", [])), maxlen=self.window)
        self._norms = LogWindow((float(x) for x in state.get("norms", [])), maxlen=self.window)
        self._spike_streak = int(state.get("spike_streak", 0))
        self._recent = deque((float(x) for x in state.get("recent", [])), maxlen=_RISE_STEPS)
        self._loss_mid = None if state.get("loss_mid") is None else float(state["loss_mid"])
        self._mid_hist = deque((float(x) for x in state.get("mid_hist", [])), maxlen=self.window)

    def state_dict(self) -> dict:
        return {
            **self.stats_state(),
            "skipped_total": self._skipped_total,
            "skipped_steps": list(self._skipped_steps)[-200:],
        }

    def load_state_dict(self, state: dict) -> None:
        self.load_stats_state(state)
        self._skipped_total = int(state.get("skipped_total", 0))
        self._skipped_steps = deque((int(s) for s in state.get("skipped_steps", [])), maxlen=_KEEP_STEPS)

    @property
    def skipped_steps(self) -> list[int]:
        return list(self._skipped_steps)

    @property
    def skipped_total(self) -> int:
        return self._skipped_total

    def add_listener(self, fn: Callable[[StepVerdict], None]) -> None:
        """`fn(verdict)` is called on every rank right after each decision (in `on_pre_optimizer_step`)."""
        self._listeners.append(fn)

    def verdict_for(self, step: int) -> StepVerdict | None:
        """The verdict of optimizer step `step`; None when the guard is off.

        Raises:
            GuardOrderError: the guard is on but has not judged `step` yet (it is listed after the caller).
        """
        if not self.enabled or self._off_reason is not None:
            return None
        if self.last_verdict is None or self.last_verdict.step != step:
            raise GuardOrderError(
                f"step {step}: SkipGuard has not judged this step yet; list SkipGuard before the guards that use "
                "its verdict (RollbackGuard, ClipGuard, SNRGuard) in Trainer(callbacks=...), or use build_guards()"
            )
        return self.last_verdict

    # --- decisions (pure, host numbers) -----------------------------------------------------------------
    def after_rollback(self, snapshot_stats: dict) -> None:
        """Called by `RollbackGuard` after restoring weights, with the references saved in the snapshot.

        The references learned since the snapshot describe the run being undone - a model trained further, and
        perhaps accepted steps of the very divergence: after a rollback to an early snapshot (whose loss is high
        by nature) its loss-rise anchor called every healthy step a rise. So a warm snapshot's references come
        back; a snapshot taken before the guard was warm (the initial one) has none worth restoring, and the
        references restart from the next accepted step with the rules still on (a re-divergence at the lowered LR
        is caught from the second step on, not after a new warm-up).
        """
        if int(snapshot_stats.get("accepted", 0)) >= self.warmup_steps:
            self.load_stats_state(snapshot_stats)
        else:
            self._norm_ema = self._loss_mid = None
            self._losses = LogWindow(maxlen=self.window)
            self._norms = LogWindow(maxlen=self.window)
            self._mid_hist = deque(maxlen=self.window)
        self._recent.clear()
        self._spike_streak = 0

    def after_bad_data(self) -> None:
        """Called by `RollbackGuard` when its check found the bad steps to be bad data (a declined rollback): the
        loss trend those batches drove up restarts from the accepted steps' smoothed loss, so the healthy batches
        after the burst are not judged a rise."""
        self._recent.clear()
        self._spike_streak = 0

    def judge_with(self, stats: dict) -> Callable[..., list[float]]:
        """`local_flags` against other references (`stats_state()` of another time, e.g. a snapshot's), leaving
        this guard's own untouched."""
        other = copy.copy(self)
        other.load_stats_state(stats)
        return other.local_flags

    def learn(self, grad_norm: float, loss: float | None) -> None:
        """Update the references with an accepted step (a zero norm is no reference: see the module docstring)."""
        if math.isfinite(grad_norm) and grad_norm > 0:
            b = self.ema_beta
            self._norm_ema = grad_norm if self._norm_ema is None else b * self._norm_ema + (1 - b) * grad_norm
            self._norms.append(grad_norm)
        if loss is not None and math.isfinite(loss):
            self._losses.append(loss)
            b = _MID_BETA
            self._loss_mid = loss if self._loss_mid is None else b * self._loss_mid + (1 - b) * loss
            self._mid_hist.append(self._loss_mid)
        self._accepted += 1

    def decide(
        self, step: int, flags: list[float], grad_norm: float, loss: float | None, no_signal: bool = False
    ) -> StepVerdict:
        """Turn agreed flags into a verdict, update the references and counters, write the event. `no_signal`: the
        step's gradient is exactly zero (only a non-finite flag can skip it; it neither teaches the references nor
        ends a streak of spike skips)."""
        if no_signal:
            flags = [f if r in _HARD else 0.0 for r, f in zip(REASONS, flags, strict=False)]
        reasons = [r for r, f in zip(REASONS, flags, strict=False) if f]
        if no_signal and not reasons:
            return self._no_signal(step, loss)
        self._no_signal_streak = 0
        if reasons and not set(_HARD) & set(reasons):  # spikes only: those can be a new normal
            self._spike_streak += 1
            if self._spike_streak > self.max_consecutive_skips:
                # A level that persists this long is the new normal (e.g. a data shift), not a spike: accept it
                # and start the references afresh from here, instead of skipping forever.
                self.event(
                    step,
                    "skip_reference_reset",
                    f"{self._spike_streak - 1} consecutive spike skips: accepting step {step} and "
                    f"re-learning the spike references from it",
                    severity="warning",
                    reasons=reasons,
                )
                reasons = []
                self._norm_ema, self._losses, self._spike_streak = None, LogWindow(maxlen=self.window), 0
                self._norms = LogWindow(maxlen=self.window)
                self._loss_mid = None
                self._recent.clear()
                self._mid_hist = deque(maxlen=self.window)
        else:
            self._spike_streak = 0
        verdict = StepVerdict(
            step=step,
            skip=bool(reasons),
            reasons=reasons,
            grad_norm=grad_norm,
            loss=math.nan if loss is None else loss,
        )
        if (
            loss is not None
            and math.isfinite(loss)
            and not {"nonfinite", "loss_spike", "grad_spike", "damaged"} & set(reasons)
        ):
            # the trend follows every plausible loss (a rising one too), but not isolated spikes
            self._recent.append(loss)
        if not verdict.skip:
            self.learn(grad_norm, loss)
        if verdict.skip:
            self._skipped_total += 1
            self._skipped_steps.append(step)
            loss_txt = "n/a" if loss is None else f"{loss:.4g}"
            ref = "n/a" if self._norm_ema is None else f"{self._norm_ema:.4g}"
            evidence = {k: round(v, 4) for k, v in self.last_evidence.items() if v is not None}
            detail = self.skip_detail(step, reasons) if self.skip_detail is not None else {}
            where = f"; rollouts: {detail['rollouts']}" if detail.get("rollouts") else ""
            self.event(
                step,
                "step_skipped",
                f"step {step} skipped on every rank ({', '.join(reasons)}): grad norm {grad_norm:.4g} "
                f"(EMA {ref}), loss {loss_txt}{explain(reasons, evidence, self.config)}; optimizer state untouched{where}",
                value=grad_norm,
                severity="warning",
                reasons=reasons,
                loss=verdict.loss,
                noise=evidence,
                **detail,
            )
        self.record({"guard/skipped": float(verdict.skip), "guard/skipped_total": float(self._skipped_total)})
        self.last_verdict = verdict
        return verdict

    def _no_signal(self, step: int, loss: float | None) -> StepVerdict:
        """A zero-gradient step: applied, no reference, the spike streak left as it is; one info note per run, and
        one warning when `_NO_SIGNAL_WARN` of them come in a row (a constant reward, a loss multiplied by 0: the run
        learns nothing - sparse-reward GRPO on the tiny test policy had at most 9 in a row)."""
        self._no_signal_total += 1
        self._no_signal_streak += 1
        if self._no_signal_streak == self.no_signal_warn_steps:
            self.event(
                step,
                "no_learning_signal",
                f"step {step}: the gradient has been exactly zero for {_NO_SIGNAL_WARN} steps in a row - the run is "
                "learning nothing (a constant reward in every group? a loss multiplied by 0?)",
                severity="warning",
            )
        if self._no_signal_total == 1:
            self.event(
                step,
                "no_learning_signal",
                f"step {step}: the gradient is exactly zero (no learning signal in this batch, e.g. equal rewards "
                "in every group); such steps are applied as usual and are not used as spike references",
                severity="info",
            )
        verdict = StepVerdict(step=step, skip=False, grad_norm=0.0, loss=math.nan if loss is None else loss)
        self.record({"guard/skipped": 0.0, "guard/skipped_total": float(self._skipped_total)})
        self.last_verdict = verdict
        return verdict

    # --- Trainer hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        if not self.enabled:
            return
        self._off_reason = None
        self.last_verdict = None
        self._judged = None
        self._use_step_tap(model)
        if model is not None:  # monitors listed before this guard read the statistics its gather takes
            GradStats.shared(model).readers.set_decider(self)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        super().on_step_begin(args, state, control, model=model, **kwargs)
        self._gathers_at_begin = GradStats.shared(model).row_gathers if model is not None else None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if model is not None and self.enabled:
            GradStats.shared(model).readers.set_decider(None)
        return super().on_train_end(args, state, control, model=model, **kwargs)

    def judges_later(self, step: int) -> bool:
        """Whether this guard will read step label `step`'s statistics later in the current `on_pre_optimizer_step`
        (decided from configuration and what it judged so far: the same on every rank)."""
        return self.enabled and self._off_reason is None and self._judged != step

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not self.enabled or self._off_reason is not None or model is None:
            return
        if self.engine_unhosted(state, model):  # the engine made the step already: nothing to judge (said once)
            self._off_reason = "the engine steps before the Trainer's on_pre_optimizer_step (use StableTrainer)"
            return
        step = state.global_step + 1
        stats = GradStats.shared(model)
        # A reader listed earlier may have gathered the rows: a gradient edited on one rank since then (a callback,
        # a fault) changed that rank's report only. Then they are gathered again here - one collective, as a
        # max-reduce of the flags would be - so every rank judges the gradients as they are now from the same
        # numbers. Whether anyone gathered is counted by `row_gathers`, the same on every rank.
        distributed = is_distributed()
        if distributed and self._gathers_at_begin not in (None, stats.row_gathers):
            stats.begin_step()
        gathers = stats.row_gathers
        report = stats.compute(model, step=state.global_step)
        if distributed and stats.row_gathers == gathers:
            stats.begin_step()
            report = stats.compute(model, step=state.global_step)
        self._judged = state.global_step
        stats.readers.flush(state.global_step)  # the monitors listed before this guard read the same report now
        den = report.extras.get("loss_den", 0.0)
        loss = report.extras["loss_num"] / den if den else None
        grad_norm = report.global_norm if report.available else 0.0
        # every rank's report came out of the gather above, and the references learn only from agreed numbers:
        # the flags are the same on every rank without a collective of their own
        flags = self.local_flags(grad_norm, loss, nonfinite_grads=report.nonfinite_total > 0)
        flags.append(float(report.ranks_differ and not flags[0]))
        flags.append(self.damage_flag(report.extras))  # GRPO/RLOO log-probs, in the same gathered rows
        no_signal = report.available and grad_norm == 0.0 and report.nonfinite_total == 0
        verdict = self.decide(step, flags, grad_norm if report.available else math.nan, loss, no_signal=no_signal)
        if verdict.skip:
            drop_gradients(optimizer, model)
        for fn in self._listeners:
            fn(verdict)
