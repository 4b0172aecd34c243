"""`RollbackGuard`: after K bad steps within a window, restore the last good weights and optimizer state exactly,
then lower the LR.

Snapshots hold the parameters the optimizer updates (for LoRA a few MB) and the optimizer state, copied to CPU
memory — or to `<output_dir>/hf_stable_rollback/rank<r>.pt` with `storage="disk"` for large full fine-tunes —
at train start and after every `snapshot_every` good steps (in `on_step_end`, after the update), postponed while
the skip guard sees the loss rising (a snapshot must not capture a divergence in progress). Restoring copies
the saved tensors back into the live ones (`copy_`, so dtype/device/identity stay and the values are bitwise
equal), removes state that did not exist at snapshot time, and restores the skip guard's spike references. The
LR factor `rollback` (see `LRControl`) is then multiplied by `lr_backoff` and persists on top of the schedule.

Escalation (`escalate=True`): a rollback to the same snapshot as the previous one (no snapshot taken in between, so
no progress was kept), after the run had recovered for at least one good step, raises the exponent: the factor is
multiplied by `lr_backoff**k` for the k-th such escalation, i.e. 0.5, then 0.25, then 0.125 (cumulative 0.5, 0.125,
0.0156). Training that recovers at the lower LR and then diverges again shows the LR overshoots the stable range by
more than one backoff; stepping faster wastes fewer steps on doomed retries, and the factor lands clearly below
the edge of stability instead of on it (a 10x LR in `benchmarks/rescue.py` ended at 2.5x the tuned LR with plain
halving, 6 % worse, and within 1 % with escalation). A new snapshot starts again at `lr_backoff`.

Data or weights (`verify=True`, memory storage): before restoring, the step's batch is re-run at the current and
at the snapshot's weights (`rollback_check`). When it is as bad at the snapshot's weights, the data is bad and
the weights are not damaged (every bad step was skipped), so the guard declines (event `rollback_declined`): no
restore, no LR change, the good steps since the snapshot are kept. A 10-batch burst of garbage in
`benchmarks/rescue.py` (`poison_burst`) cost 5-7 % of eval loss through an unneeded rollback without this check.

Bursts: when K more bad steps follow a rollback with no step applied in between, the weights and optimizer state
are still exactly the snapshot's and the LR was never used, so restoring again would only lower the LR. The guard
then keeps skipping without a rollback or backoff (event `rollback_held`, once per burst): a run of bad batches is
a data fault, and punishing the LR for it would slow the rest of the run.

What is not rewound: the data stream and the schedule. The batches that triggered the rollback are therefore
never seen again, and the good batches trained since the snapshot are dropped (the event says how many steps).
Bad steps come from the agreed `SkipGuard` verdicts, so every rank rolls back at the same step without another
collective. If the optimizer was switched (optimizer phases) since the snapshot, only the weights are restored
and the new optimizer's state is reset (the saved state belongs to a different optimizer).
"""

from __future__ import annotations

import copy
import os
from collections import deque
from pathlib import Path

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.distributed import drop_gradients, rank_of
from hf_stable.callbacks.guards.lr_control import LRControl, unwrap_optimizer
from hf_stable.callbacks.guards.rollback_check import probe_snapshot, weights_damaged
from hf_stable.callbacks.guards.skip_step import SkipGuard
from hf_stable.distributed import sharded_training


def _to_cpu(value) -> tuple:
    """(tensor on CPU, original device) for tensors; (None, a deep copy) for Python values (e.g. an int step)."""
    if isinstance(value, torch.Tensor):
        return (value.detach().to("cpu", copy=True), str(value.device))
    return (None, copy.deepcopy(value))


def _params(optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


class RollbackGuard(StabilityCallback):
    """Restores the last snapshot after `bad_steps` skipped steps within `window` steps; event `rollback`.

    Args:
        skip_guard: the `SkipGuard` whose verdicts count as bad steps (listed before this guard).
        lr_control: the `LRControl` holding the persistent `rollback` LR factor.
        snapshot_every: take a snapshot after this many good steps.
        bad_steps: K, the number of bad steps ...
        window: ... within this many optimizer steps that triggers a rollback.
        lr_backoff: multiply the `rollback` LR factor by this at each rollback.
        escalate: a repeat rollback to the same snapshot after at least one good step raises the backoff exponent.
        verify: before restoring, probe the step's batch at the snapshot's weights (`rollback_check`); when it is as
            bad there (bad data, not damaged weights) decline the rollback (memory storage only).
        storage: "memory" (CPU copies) or "disk" (one file per rank under the output dir).
        max_rollbacks: after this many rollbacks only skip (event `rollback_exhausted`).
        enabled: when False the callback does nothing.

    Example:
        >>> skip, lr = SkipGuard(), LRControl()
        >>> callbacks = [skip, RollbackGuard(skip, lr, snapshot_every=20), lr]
    """

    def __init__(
        self,
        skip_guard: SkipGuard,
        lr_control: LRControl,
        snapshot_every: int = 50,
        bad_steps: int = 3,
        window: int = 20,
        lr_backoff: float = 0.5,
        escalate: bool = True,
        verify: bool = True,
        storage: str = "memory",
        max_rollbacks: int = 10,
        enabled: bool = True,
    ):
        super().__init__(enabled)
        self.skip_guard = skip_guard
        self.lr_control = lr_control
        self.snapshot_every = snapshot_every
        self.bad_steps = bad_steps
        self.window = window
        self.lr_backoff = lr_backoff
        self.escalate = escalate
        self.verify = verify
        self._repeats = 0  # backoff exponent of the last rollback to the current snapshot (0: none yet)
        self._held_said = False
        self.storage = storage
        self.max_rollbacks = max_rollbacks
        self._bad: deque[int] = deque()
        self._good_since = 0
        self._rollbacks = 0
        self._exhausted_said = False
        self._snapshot: dict | None = None
        self._snapshot_step: int | None = None
        self._path: Path | None = None
        self._rolled_back_at: int | None = None
        self._off = False

    @classmethod
    def from_config(cls, cfg, skip_guard: SkipGuard, lr_control: LRControl) -> RollbackGuard:
        names = ("snapshot_every", "bad_steps", "window", "lr_backoff", "escalate", "verify", "storage",
                 "max_rollbacks", "enabled")
        return cls(skip_guard, lr_control, **{n: getattr(cfg, n) for n in names})

    # --- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"bad": list(self._bad), "good_since": self._good_since, "rollbacks": self._rollbacks,
                "repeats": self._repeats, "held_said": self._held_said}

    def load_state_dict(self, state: dict) -> None:
        self._bad = deque(int(s) for s in state.get("bad", []))
        self._good_since = int(state.get("good_since", 0))
        self._rollbacks = int(state.get("rollbacks", 0))
        self._repeats = int(state.get("repeats", 0))
        self._held_said = bool(state.get("held_said", False))

    @property
    def rollbacks(self) -> int:
        return self._rollbacks

    @property
    def snapshot_step(self) -> int | None:
        return self._snapshot_step

    # --- snapshot / restore -------------------------------------------------------------------------------
    def take_snapshot(self, step: int, optimizer, reset_counter: bool = True) -> None:
        """Copy the optimizer's parameters and state (and the skip guard's references) to CPU or disk."""
        opt = unwrap_optimizer(optimizer)
        params = _params(opt)
        index = {id(p): i for i, p in enumerate(params)}
        snap = {
            "step": step,
            "optimizer_type": type(getattr(opt, "current", opt)).__name__,
            "params": [p.detach().to("cpu", copy=True) for p in params],
            "state": {index[id(p)]: {k: _to_cpu(v) for k, v in s.items()}
                      for p, s in opt.state.items() if id(p) in index},
            "skip_stats": self.skip_guard.stats_state(),
        }
        if self.storage == "disk" and self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._path.with_suffix(".tmp")
            torch.save(snap, tmp)
            os.replace(tmp, self._path)  # a crash mid-write never leaves a torn snapshot
            self._snapshot = {"step": step}
        else:
            self._snapshot = snap
        self._snapshot_step = step
        self._repeats = 0
        if reset_counter:
            self._good_since = 0

    def _load_snapshot(self) -> dict | None:
        if self._snapshot is None:
            return None
        if "params" in self._snapshot:
            return self._snapshot
        return torch.load(self._path, map_location="cpu", weights_only=False)

    def restore(self, optimizer) -> tuple[int, bool]:
        """Put the snapshot back; returns (snapshot step, whether the optimizer state was restored too)."""
        snap = self._load_snapshot()
        opt = unwrap_optimizer(optimizer)
        params = _params(opt)
        if snap is None or len(snap["params"]) != len(params):
            raise RuntimeError("rollback snapshot does not match the optimizer's parameters")
        with torch.no_grad():
            for p, saved in zip(params, snap["params"]):
                p.copy_(saved)
        same_opt = snap["optimizer_type"] == type(getattr(opt, "current", opt)).__name__
        for i, p in enumerate(params):
            saved = snap["state"].get(i) if same_opt else None
            if saved is None:
                opt.state.pop(p, None)
                continue
            live = opt.state[p]
            for key in [k for k in live if k not in saved]:
                del live[key]
            for key, (value, device) in saved.items():
                if value is None:
                    live[key] = copy.deepcopy(device)
                    continue
                cur = live.get(key)
                if isinstance(cur, torch.Tensor) and cur.shape == value.shape and cur.dtype == value.dtype:
                    cur.copy_(value)
                else:
                    live[key] = value.to(device, copy=True)
        self.skip_guard.after_rollback(snap["skip_stats"])
        return snap["step"], same_opt

    # --- Trainer hooks ----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        super().on_train_begin(args, state, control, optimizer=optimizer, **kwargs)
        self._off = sharded_training(args) is not None or optimizer is None
        if not self.enabled or self._off:
            return
        self._path = Path(args.output_dir) / "hf_stable_rollback" / f"rank{rank_of(args)}.pt"
        # On resume the checkpoint's weights are the snapshot; the snapshot clock keeps its restored count so
        # later snapshots fall on the same steps as in an uninterrupted run.
        self.take_snapshot(state.global_step, optimizer, reset_counter=state.global_step == 0)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        if not self.enabled or self._off:
            return
        step = state.global_step + 1
        verdict = self.skip_guard.verdict_for(step)
        if verdict is None or not verdict.skip:
            return
        self._bad.append(step)
        while self._bad and self._bad[0] <= step - self.window:
            self._bad.popleft()
        if len(self._bad) < self.bad_steps:
            return
        if self._repeats and self._good_since == 0:
            # Every step since the last restore was skipped: the weights and optimizer state are still the
            # snapshot's, and the LR was not used - restoring again would change nothing but the LR.
            self._bad.clear()
            if not self._held_said:
                self._held_said = True
                self.event(step, "rollback_held",
                           f"{self.bad_steps} more bad steps right after the rollback, none applied since: the "
                           f"weights are still the snapshot of step {self._snapshot_step}; skipping them without "
                           "another LR backoff (a burst of bad data, not the LR)", value=self._snapshot_step,
                           threshold=self.bad_steps, severity="warning")
            return
        if self._rollbacks >= self.max_rollbacks:
            if not self._exhausted_said:
                self._exhausted_said = True
                self.event(step, "rollback_exhausted", f"{self._rollbacks} rollbacks done (max_rollbacks); "
                           "bad steps are only skipped from now on", severity="error")
            return
        checked = "not checked"
        if self.verify and self.storage == "memory" and model is not None and self._snapshot is not None:
            probes = probe_snapshot(model, _params(unwrap_optimizer(optimizer)), self._snapshot["params"], args)
            damaged = None if probes is None else weights_damaged(
                verdict.grad_norm, verdict.loss, *probes, judge=self.skip_guard.local_flags)
            if damaged is False:
                self._bad.clear()
                now, snap = probes
                self.event(step, "rollback_declined",
                           f"{self.bad_steps} bad steps within {self.window}, but the weights are not the cause: "
                           f"re-run now {now}, at the snapshot's weights (step {self._snapshot_step}) {snap} - "
                           "the batch is as bad there, or the fault does not reproduce. Bad data: every bad step "
                           "was skipped, nothing to undo, LR unchanged",
                           value=self._snapshot_step, threshold=self.bad_steps, severity="warning",
                           grad_norm_now=now.grad_norm, grad_norm_snapshot=snap.grad_norm)
                return
            checked = "damaged weights" if damaged else "inconclusive"
        snap_step, with_state = self.restore(optimizer)
        drop_gradients(optimizer, model)  # the skip guard dropped them already; be explicit for custom orders
        # the backoff exponent grows when the run had recovered since the last rollback to this snapshot
        self._repeats += 1
        backoff = self.lr_backoff ** (self._repeats if self.escalate else 1)
        factor = self.lr_control.multiply("rollback", backoff)
        self._rollbacks += 1
        self._bad.clear()
        self._good_since = 0
        self._rolled_back_at = step
        note = "" if with_state else " (optimizer changed since the snapshot: its state was reset)"
        escalated = " (escalated: diverged again after recovering at the lower LR)" if self._repeats > 1 else ""
        self.event(step, "rollback",
                   f"{self.bad_steps} bad steps within {self.window}: restored the snapshot of step {snap_step} "
                   f"(undoing steps {snap_step + 1}-{step}){note}; LR x{backoff:.4g}"
                   f"{escalated}, factor now {factor:.4g}",
                   value=snap_step, threshold=self.bad_steps, severity="error", lr_factor=factor,
                   backoff=backoff, rollbacks=self._rollbacks, check=checked)
        self.record({"guard/rollbacks": float(self._rollbacks)})

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.enabled and not self._off and optimizer is not None:
            verdict = self.skip_guard.last_verdict
            good = verdict is None or verdict.step != state.global_step or not verdict.skip
            if good and self._rolled_back_at != state.global_step:
                self._good_since += 1
                self._held_said = False
                if self._good_since >= self.snapshot_every and self.skip_guard.healthy:
                    self.take_snapshot(state.global_step, optimizer)
        super().on_step_end(args, state, control, optimizer=optimizer, **kwargs)
