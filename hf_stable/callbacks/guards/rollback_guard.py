"""`RollbackGuard`: after K bad steps within a window, restore the last good weights and optimizer state exactly,
then lower the LR (factor `rollback` in `LRControl`, times `lr_backoff`, kept on top of the schedule).

* Snapshots (`core.snapshot`): the parameters the optimizer updates, its state and the references of the guards that
  learn from accepted steps (skip references, adaptive clip statistics), so the restored run is judged by what was
  normal at the snapshot. Taken at train start, then every `min(snapshot_every, max(snapshot_min_every,
  ceil(snapshot_share x step)))` good steps (a rollback undoes about `snapshot_share` of the run), postponed while
  the loss rises; a function of agreed, resumed counters, so the same steps on every rank and after a resume.
* Host memory: sized before the first snapshot (`core.snapshot_size`); one that does not fit `host_memory_share` of
  the available memory goes to disk (`guard_notice`), one that fits nowhere is a `ConfigError`; agreed over ranks.
* `escalate`: a repeat rollback to the same snapshot after the run had recovered multiplies by `lr_backoff**k`
  (0.5, 0.25, 0.125): the LR overshoots by more than one backoff (`benchmarks/rescue.py` lr_10x: 6 % -> 1 %).
* `verify` (`core.rollback_check`): the step's batch is re-run at the current and the snapshot's weights, the
  snapshot judged by its own references; as bad there (bad data) or a non-finite batch at weights that still handle
  the last accepted batch (an input that overflows) -> `rollback_declined`, nothing restored, LR unchanged.
* More bad steps right after a rollback with nothing applied since -> only skipped (`rollback_held`): the weights
  are still the snapshot's, another restore would only cut the LR.
* A repeat rollback to the same snapshot for non-finite steps only (no spike or rise in the window), when the last
  one was for non-finite steps too and the weights are finite -> `rollback_declined` (`reason: repeat_nonfinite`),
  skip only: restoring that snapshot at a lower LR was tried, the run recovered and came back to non-finite steps,
  so they come from inputs the trained weights overflow on (fp16), not from an LR overshoot; a restore would only
  drop the progress and cut the LR again (`benchmarks/rescue.py` fp16 seed 3: three restores of step 0 took the
  factor to 0.016, 2.69x the clean loss). Spikes still escalate (their size follows the LR); non-finite weights
  are still restored.
* Not rewound: the data stream and the schedule (the event says how many good steps were dropped). Bad steps come
  from the agreed `SkipGuard` verdicts, so every rank rolls back at the same step; the only collectives are the
  check's and the weights-finite flag of a repeat, entered by every rank from that agreed state.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.callbacks.guards.skip_guard import SkipGuard
from hf_stable.config.guards import RollbackConfig
from hf_stable.core.engine import StepEngine
from hf_stable.core.monitor_utils import collective_device
from hf_stable.core.rank_agreement import agree, drop_gradients, rank_of
from hf_stable.core.rollback_check import probe_inputs, probe_snapshot, weights_damaged
from hf_stable.core.snapshot import SnapshotStore, optimizer_params
from hf_stable.core.snapshot_size import plan_storage, snapshot_size
from hf_stable.core.step_tap import StepTap
from hf_stable.errors import ConfigError


class RollbackGuard(StabilityCallback):
    """Restores the last snapshot after `bad_steps` skipped steps within `window` steps; event `rollback`.

    Args:
        skip_guard: the `SkipGuard` whose verdicts count as bad steps (listed before this guard).
        lr_control: the `LRControl` holding the persistent `rollback` LR factor.
        config: a `RollbackConfig` (default `RollbackConfig()`; every field is documented there and in
            docs/CONFIG.md).
        followers: more guards whose references roll back with the weights (`stats_state()` / `after_rollback()`,
            e.g. `ClipGuard`); the skip guard always does.
        **overrides: `RollbackConfig` fields to change, e.g. `RollbackGuard(skip, lr, snapshot_every=20)`.

    Raises:
        ConfigError: at train start, when a snapshot fits neither in host memory nor on disk.

    Example:
        >>> skip, lr = SkipGuard(), LRControl()
        >>> callbacks = [skip, RollbackGuard(skip, lr, snapshot_every=20), lr]
    """

    def __init__(
        self,
        skip_guard: SkipGuard,
        lr_control: LRControl,
        config: RollbackConfig | None = None,
        *,
        followers: list | None = None,
        **overrides,
    ):
        super().__init__()
        cfg = self._use_config(RollbackConfig, config, overrides)
        storage, verify = cfg.storage, cfg.verify
        self.skip_guard = skip_guard
        self.lr_control = lr_control
        self.followers = [skip_guard, *(followers or [])]
        self._repeats = 0  # backoff exponent of the last rollback to the current snapshot (0: none yet)
        self._held_said = False
        self._bad: deque[int] = deque()
        self._finite_bad: set[int] = set()  # bad steps in the window with a finite instability (spike, rise)
        self._last_nonfinite = False  # the last rollback to the current snapshot came from non-finite steps only
        self._good_since = 0
        self._rollbacks = 0
        self._exhausted_said = False
        self._store = SnapshotStore(storage)
        self._plan = (storage, verify)  # (storage, verify) in use, decided at train start
        self._rolled_back_at: int | None = None
        # the last accepted steps' micro-batches (references, newest last) for the check
        self._good_inputs: deque[list] = deque(maxlen=max(1, cfg.verify_batches))
        self._off = False
        self._model = None
        self._engine: StepEngine | None = None

    # --- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "bad": list(self._bad),
            "good_since": self._good_since,
            "rollbacks": self._rollbacks,
            "repeats": self._repeats,
            "held_said": self._held_said,
            "finite_bad": sorted(self._finite_bad),
            "last_nonfinite": self._last_nonfinite,
        }

    def load_state_dict(self, state: dict) -> None:
        self._bad = deque(int(s) for s in state.get("bad", []))
        self._good_since = int(state.get("good_since", 0))
        self._rollbacks = int(state.get("rollbacks", 0))
        self._repeats = int(state.get("repeats", 0))
        self._held_said = bool(state.get("held_said", False))
        self._finite_bad = {int(s) for s in state.get("finite_bad", [])}
        self._last_nonfinite = bool(state.get("last_nonfinite", False))

    @property
    def rollbacks(self) -> int:
        return self._rollbacks

    @property
    def snapshot_step(self) -> int | None:
        return self._store.step

    @property
    def storage_in_use(self) -> str:
        return self._store.storage

    def interval(self, step: int) -> int:
        """Good steps between snapshots at optimizer step `step` (see the module doc)."""
        if self.snapshot_share is None:
            return self.snapshot_every
        return min(self.snapshot_every, max(self.snapshot_min_every, math.ceil(self.snapshot_share * step)))

    def _clear_window(self) -> None:
        self._bad.clear()
        self._finite_bad.clear()

    def _weights_finite(self, args, optimizer) -> bool:
        """Every parameter the optimizer updates is finite, on every rank (one collective)."""
        engine = StepEngine.of(self._model) if self._model is not None else None
        params = [engine.local(p) if engine is not None else p for p in optimizer_params(optimizer)]
        bad = any(not bool(torch.isfinite(p).all()) for p in params)
        return not agree([float(bad)], collective_device(args))[0]

    # --- snapshot / restore -------------------------------------------------------------------------------
    def take_snapshot(self, step: int, optimizer, reset_counter: bool = True) -> None:
        """Save the optimizer's parameters and state and the followers' references (CPU memory or disk)."""
        states = {f.state_key: f.stats_state() for f in self.followers}
        self._store.save(step, optimizer, states, engine=self._engine, model=self._model)
        self._repeats = 0
        if reset_counter:
            self._good_since = 0

    def restore(self, optimizer) -> tuple[int, bool]:
        """Put the snapshot back; returns (snapshot step, whether the optimizer state was restored too)."""
        step, same_opt, guard_states = self._store.restore(optimizer, engine=self._engine, model=self._model)
        for f in self.followers:
            if f.state_key in guard_states:
                f.after_rollback(guard_states[f.state_key])
        return step, same_opt

    def _choose_storage(self, args, step: int, optimizer) -> None:
        """Size the snapshot before the first one is taken; switch to disk or refuse when it does not fit."""
        size = snapshot_size(optimizer)
        plan = plan_storage(size, self.storage, self.verify, args.output_dir, self.host_memory_share)
        # every rank must store (and verify) alike: the probe is a collective
        flags = agree(
            [float(bool(plan.error)), float(plan.storage == "disk"), float(not plan.verify)], collective_device(args)
        )
        if flags[0]:
            raise ConfigError([f"stability.guards.rollback.storage: {plan.error or 'does not fit on another rank'}"])
        storage, verify = ("disk" if flags[1] else "memory"), not flags[2]
        self._store = SnapshotStore(storage, Path(args.output_dir) / "hf_stable_rollback" / f"rank{rank_of(args)}.pt")
        # the check re-runs the model at the snapshot's weights: not under an engine that shards them
        can_rerun = self._engine is None or self._engine.can_rerun
        self._plan = (storage, verify and self.verify and can_rerun)
        if plan.note or storage != self.storage:
            self.event(
                step,
                "guard_notice",
                plan.note
                or f"another rank's snapshots do not fit in host memory: "
                f"rollback snapshots go to disk on every rank ({size.describe()})",
                severity="warning",
                storage=storage,
                snapshot_bytes=size.snapshot,
                verify=self._plan[1],
            )

    # --- Trainer hooks ----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
        super().on_train_begin(args, state, control, optimizer=optimizer, model=model, **kwargs)
        self._off = optimizer is None
        self._model = model
        self._engine = StepEngine.of(model, refresh=True) if model is not None else None
        if not self.enabled or self._off:
            return
        self._choose_storage(args, state.global_step, optimizer)
        # On resume the checkpoint's weights are the snapshot; the snapshot clock keeps its restored count so
        # later snapshots fall on the same steps as in an uninterrupted run.
        self.take_snapshot(state.global_step, optimizer, reset_counter=state.global_step == 0)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        if not self.enabled or self._off:
            return
        if model is not None and self.engine_unhosted(state, model):  # said once; no snapshots for nothing
            self._off = True
            return
        step = state.global_step + 1
        verdict = self.skip_guard.verdict_for(step)
        if verdict is None or not verdict.skip:
            return
        self._bad.append(step)
        if set(verdict.reasons) - {"nonfinite", "damaged"}:  # a damaged RL step is treated as a non-finite one
            self._finite_bad.add(step)
        while self._bad and self._bad[0] <= step - self.window:
            self._finite_bad.discard(self._bad.popleft())
        if len(self._bad) < self.bad_steps:
            return
        snap_step = self._store.step
        if self._repeats and self._good_since == 0:
            # Every step since the last restore was skipped: the weights and optimizer state are still the
            # snapshot's, and the LR was not used - restoring again would change nothing but the LR.
            self._clear_window()
            if not self._held_said:
                self._held_said = True
                self.event(
                    step,
                    "rollback_held",
                    f"{self.bad_steps} more bad steps right after the rollback, none applied since: the "
                    f"weights are still the snapshot of step {snap_step}; skipping them without "
                    "another LR backoff (a burst of bad data, not the LR)",
                    value=snap_step,
                    threshold=self.bad_steps,
                    severity="warning",
                )
            return
        if self._rollbacks >= self.max_rollbacks:
            if not self._exhausted_said:
                self._exhausted_said = True
                self.event(
                    step,
                    "rollback_exhausted",
                    f"{self._rollbacks} rollbacks done (max_rollbacks); bad steps are only skipped from now on",
                    severity="error",
                )
            return
        nonfinite_only = not self._finite_bad
        if self._repeats and self._last_nonfinite and nonfinite_only and self._weights_finite(args, optimizer):
            # A restore of this snapshot at a lower LR was tried for non-finite steps, the run recovered from it
            # (steps applied since) and reached non-finite steps again: restoring it once more cannot cure them
            # (inputs that training at any LR leads to overflow, e.g. fp16), it would only drop the progress and
            # cut the LR further. Non-finite steps were skipped and the weights are finite: skip only.
            self._clear_window()
            self.event(
                step,
                "rollback_declined",
                f"{self.bad_steps} non-finite steps within {self.window}, again after the rollback to the snapshot "
                f"of step {snap_step} and the steps applied since: restoring it again cannot cure them (inputs "
                "the trained weights overflow on, not an LR overshoot). Every bad step was skipped, nothing to "
                "undo, LR unchanged",
                value=snap_step,
                threshold=self.bad_steps,
                severity="warning",
                reason="repeat_nonfinite",
            )
            return
        checked = "not checked"
        if self._plan[1] and model is not None and not self._store.empty:
            snapshot = self._store.load()
            pooled = list(self._good_inputs)[-self.verify_batches :] if self.verify_batches else []
            extra = [micro for step_inputs in pooled for micro in step_inputs]
            probes = probe_snapshot(model, optimizer_params(optimizer), snapshot["params"], args, extra=extra)
            saved = snapshot["guard_states"].get(self.skip_guard.state_key, {})
            recent = None
            if probes is not None and not probes[0].finite and probes[1].finite:  # agreed values: all ranks enter
                last = self._good_inputs[-1] if self._good_inputs else None
                recent = probe_inputs(model, optimizer_params(optimizer), last, args)
            damaged = (
                None
                if probes is None
                else weights_damaged(
                    verdict.grad_norm,
                    verdict.loss,
                    *probes,
                    judge=self.skip_guard.judge_with(saved),
                    recent=recent,
                    margin=self.verify_margin,
                )
            )
            del snapshot
            if damaged is False:
                self._clear_window()
                self.skip_guard.after_bad_data()
                now, snap = probes
                self.event(
                    step,
                    "rollback_declined",
                    f"{self.bad_steps} bad steps within {self.window}, but the weights are not the cause: the "
                    f"step's batch and {len(pooled)} accepted steps' re-run now: {now}, at the snapshot's weights "
                    f"(step {snap_step}): {snap} - the snapshot does not do clearly better (loss "
                    f"{self.verify_margin:.0%} lower or gradient norm halved), or the fault does not reproduce. Bad "
                    "data or noise: every bad step was skipped, nothing to undo, LR unchanged",
                    value=snap_step,
                    threshold=self.bad_steps,
                    severity="warning",
                    grad_norm_now=now.grad_norm,
                    grad_norm_snapshot=snap.grad_norm,
                    loss_now=now.loss,
                    loss_snapshot=snap.loss,
                    batches=1 + len(pooled),
                )
                return
            checked = "damaged weights" if damaged else "inconclusive"
        snap_step, with_state = self.restore(optimizer)
        drop_gradients(optimizer, model)  # the skip guard dropped them already; be explicit for custom orders
        # the backoff exponent grows when the run had recovered since the last rollback to this snapshot
        self._repeats += 1
        backoff = self.lr_backoff ** (self._repeats if self.escalate else 1)
        self._last_nonfinite = nonfinite_only
        factor = self.lr_control.multiply("rollback", backoff)
        self._rollbacks += 1
        self._clear_window()
        self._good_since = 0
        self._rolled_back_at = step
        note = "" if with_state else " (optimizer changed since the snapshot: its state was reset)"
        escalated = " (escalated: diverged again after recovering at the lower LR)" if self._repeats > 1 else ""
        self.event(
            step,
            "rollback",
            f"{self.bad_steps} bad steps within {self.window}: restored the snapshot of step {snap_step} "
            f"(undoing steps {snap_step + 1}-{step}){note}; LR x{backoff:.4g}"
            f"{escalated}, factor now {factor:.4g}",
            value=snap_step,
            threshold=self.bad_steps,
            severity="error",
            lr_factor=factor,
            backoff=backoff,
            rollbacks=self._rollbacks,
            check=checked,
        )
        self.record({"guard/rollbacks": float(self._rollbacks)})

    def on_step_end(self, args, state, control, optimizer=None, model=None, **kwargs):
        if self.enabled and not self._off and optimizer is not None:
            verdict = self.skip_guard.last_verdict
            good = verdict is None or verdict.step != state.global_step or not verdict.skip
            if good and self._rolled_back_at != state.global_step:
                if model is not None:  # a reference to the list the tap filled this step (it starts a new one)
                    self._good_inputs.append(StepTap.shared(model).inputs)
                self._good_since += 1
                self._held_said = False
                if self._good_since >= self.interval(state.global_step) and self.skip_guard.healthy:
                    self.take_snapshot(state.global_step, optimizer)
        super().on_step_end(args, state, control, optimizer=optimizer, model=model, **kwargs)
