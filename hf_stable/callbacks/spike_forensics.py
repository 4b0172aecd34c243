"""`SpikeForensics`: name the training records behind every bad step, quarantine them, and (``auto``) never train
on them again - on every rank, across resumes.

* **Attribution** (`hf_stable.forensics.attribution`): when the skip guard skips a step (non-finite, grad or loss
  spike, loss rise - the steps a rollback counts), the step's captured micro-batches are re-run without grad for
  every sample's own loss, at the current weights and at the rollback snapshot's when one is kept; the rows are
  gathered over ranks and every rank names the same culprits. Each culprit's gradient norm (the sample alone) is
  added as evidence. Cost: only on bad steps - one forward of the step (two with a snapshot) plus one
  forward/backward per culprit.
* **Screening** (``data.screen: true``, `hf_stable.forensics.screened_forwards`): every training forward's
  per-sample losses are computed on device from its logits (with the chunked training loss, from its chunks:
  `hf_stable.loss`) and kept on device; every `screen_every` steps (and before a checkpoint, so a resume sees the
  same decisions) they are gathered once and judged against the running distribution of healthy per-sample losses.
  Outliers go through the same quarantine; the rest feed the distribution. No host sync on the other steps.
* **Trajectories** (with screening, `hf_stable.forensics.trajectory`): the same forwards' per-sample loss and
  margin go into a per-record history (gathered with the screening's decisions, identical on every rank, in the
  checkpoints); at the end of each epoch the records whose loss stays high and whose answer stays confidently
  wrong while the population's falls are named (``trajectory``) and, with ``auto``, left out of later epochs.
* **Quarantine** (`hf_stable.forensics.quarantine`): ``quarantine.jsonl`` in the output dir and a
  ``samples_quarantined`` event; with ``auto`` the train sampler (`StableTrainer._get_train_sampler`) skips the
  records from the sampler position they were named at. The quarantine is in the callback state (checkpoints).
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.core.engine import StepEngine
from hf_stable.core.events import LR_SIGNS
from hf_stable.core.step_tap import StepTapUser
from hf_stable.distributed import all_reduce_flag, all_reduce_tensor, rank
from hf_stable.forensics.attribution import (
    Culprit,
    SampleRow,
    confirm_at_snapshot,
    culprit_grad_norms,
    gather_rows,
    grad_outliers,
    judge,
    local_sample_losses,
    ratios,
    sample_grad_norms,
    snapshot_sample_losses,
)
from hf_stable.forensics.config import ForensicsConfig
from hf_stable.forensics.epoch_verdicts import EpochVerdicts
from hf_stable.forensics.quarantine import Entry, Quarantine, QuarantineSampler
from hf_stable.forensics.screened_forwards import ScreenedForwards

__all__ = ["FORENSICS_EVENT_KINDS", "ForensicsConfig", "SpikeForensics", "build_forensics"]

FORENSICS_EVENT_KINDS = {
    "samples_quarantined": "training records named as the culprits of a bad step (quarantine.jsonl)",
    "step_forensics": "per-sample losses of a bad step against the healthy distribution",
}


MAX_LISTED = 3  # records named in a console line; the event's `records` and quarantine.jsonl keep them all


def _num(x: float) -> float | str:
    return round(x, 6) if math.isfinite(x) else str(x)


def _where(records, record_id: int) -> tuple[str, str, str]:
    info = records.get(record_id) if records is not None else None
    return (info.where, info.hash, info.preview) if info is not None else (f"record {record_id}", "", "")


class SpikeForensics(ScreenedForwards, EpochVerdicts, StepTapUser, StabilityCallback):
    """Names the records behind bad steps and quarantines them; events `step_forensics`, `samples_quarantined`.

    Args:
        cfg: a `ForensicsConfig` (``quarantine: off`` disables the callback).
        records: the run's `RecordTable` (`DataBundle.records`), which names record ids by file:line.

    Example:
        >>> forensics = SpikeForensics(ForensicsConfig(), data.records).attach(callbacks)
        >>> trainer = StableTrainer(..., callbacks=callbacks + [forensics])
    """

    def __init__(self, cfg: ForensicsConfig, records=None):
        super().__init__(cfg.quarantine != "off")
        self.cfg = cfg
        self.records = records
        self.quarantine = Quarantine(cfg.quarantine)
        self.sampler = None  # the QuarantineSampler, set by StableTrainer
        self._reference: deque[float] = deque(maxlen=cfg.window)
        self._skip = None
        self._rollback = None
        self._monitors: list[StabilityCallback] = []  # their events: the weights' signs (`_weights_suspect`)
        self._model = self._optimizer = self._args = None
        self._step = 0
        self._bad_steps: set[int] = set()
        self._buffer: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, dict]] = []
        self.screen_seconds = 0.0  # screening's own work (its step-time cost), logged as perf/forensics_screen_s
        self.forensics_seconds = 0.0  # the bad steps' attribution, logged as perf/forensics_s
        self._init_trajectory(cfg, records)

    def attach(self, callbacks) -> SpikeForensics:
        """Listen to the skip guard among `callbacks` (and read the rollback guard's snapshot); returns self."""
        from hf_stable.callbacks.guards.rollback_guard import RollbackGuard
        from hf_stable.callbacks.guards.skip_guard import SkipGuard

        for cb in callbacks:
            if isinstance(cb, SkipGuard) and self._skip is None:
                self._skip = cb
                cb.add_listener(self._on_verdict)
            elif isinstance(cb, RollbackGuard):
                self._rollback = cb
        self._monitors = [cb for cb in callbacks if isinstance(cb, StabilityCallback) and cb is not self]
        return self

    # --- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            **self.quarantine.state_dict(),
            "reference": list(self._reference),
            **self._trajectory_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.quarantine.load_state_dict(state)
        self._reference = deque((float(x) for x in state.get("reference", [])), maxlen=self.cfg.window)
        self._load_trajectory_state(state)

    # --- Trainer hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, optimizer=optimizer, **kwargs)
        if not self.enabled:
            return
        self._model, self._optimizer, self._args = model, optimizer, args
        self._init_token_prefixes(kwargs.get("processing_class"))
        self.quarantine.output_dir = args.output_dir if state.is_world_process_zero else None
        self.quarantine.rewrite()  # a resume: the file holds what the checkpoint holds
        tap = self._use_step_tap(model)
        if tap is not None and self.cfg.screen:  # the chunked training loss's chunks serve it (no whole logits)
            tap.add_output_listener(self._screen_forward, reads_chunks=True, row_fn=self._answer_rows)
        if self.cfg.screen and getattr(self.records, "degenerate", None):
            # the same table on every rank (built from the data): an agreed list, named before any step
            degenerate = [
                Culprit(SampleRow(rid, math.nan, 0, math.nan, 0), "degenerate_answer", detail={"compression": ratio})
                for rid, ratio in sorted(self.records.degenerate.items())
            ]
            self._quarantine(state.global_step, degenerate, math.nan, ["screen"])

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self._step = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.enabled and self.cfg.screen:
            step = state.global_step
            # rank-agreed: the step number and the Trainer's save/stop flags (set identically on every rank)
            if step % self.cfg.screen_every == 0 or control.should_save or control.should_training_stop:
                started = time.perf_counter()
                self._flush_screen(step)
                self._flush_trajectory()
                self.screen_seconds += time.perf_counter() - started
        if self.enabled and (self.screen_seconds or self.forensics_seconds):
            self.record(
                {
                    "perf/forensics_screen_s": round(self.screen_seconds, 4),
                    "perf/forensics_s": round(self.forensics_seconds, 4),
                    **({"perf/forensics_trajectory_s": round(self.trajectory_seconds, 4)} if self.trajectory else {}),
                }
            )
        super().on_step_end(args, state, control, **kwargs)

    # --- attribution of a bad step -------------------------------------------------------------------------
    def _on_verdict(self, verdict) -> None:
        if not self.enabled or not verdict.skip or self._model is None or self._tap is None:
            return
        self._bad_steps.add(verdict.step)
        self._attribute(verdict.step, list(verdict.reasons))

    def _attribute(self, step: int, step_reasons: list[str]) -> None:
        started = time.perf_counter()
        device = next(self._model.parameters()).device
        engine = StepEngine.of(self._model)  # sharded: every rank re-runs its own micro-batches (equal counts)
        store = None
        try:
            per = local_sample_losses(self._model, self._tap, self._args)
            store = getattr(self._rollback, "_store", None) if engine.can_rerun else None
            snap = snapshot_sample_losses(self._model, self._optimizer, store, self._tap, per, self._args)
        except Exception:  # noqa: BLE001 - e.g. out of memory: this rank brings no rows, the collectives still run
            per, snap = [], None
        parts, located = [], {}
        me = float(rank())
        for k, (mb, _n, ids, stacked) in enumerate(per):
            ids_f = ids.to(device, torch.float64)
            snap_loss = snap[k].to(device, torch.float64) if snap is not None else torch.full_like(ids_f, math.nan)
            parts.append(
                torch.stack(
                    [ids_f, stacked[0].double(), stacked[1].double(), snap_loss, torch.full_like(ids_f, me)], dim=1
                )
            )
            for seg, rid in enumerate(ids.tolist()):
                if rid >= 0:
                    located[rid] = (mb, seg)
        local = torch.cat(parts) if parts else torch.zeros((0, 5), dtype=torch.float64, device=device)
        rows = gather_rows(local)
        reference = list(self._reference) if len(self._reference) >= self.cfg.min_reference else None
        culprits, suspects, med = judge(
            rows, reference, zscore=self.cfg.zscore, min_rel=self.cfg.min_rel, min_excess=self.cfg.min_excess_nats
        )
        params = None
        if self._optimizer is not None:
            from hf_stable.core.snapshot import optimizer_params

            params = optimizer_params(self._optimizer)
        by_grad = (
            not culprits
            and params is not None
            and engine.can_rerun  # a sample's backward alone: not under an engine whose backward is collective
            and {"grad_spike", "nonfinite"} & set(step_reasons)
            and 0 < len(rows) <= self.cfg.max_grad_samples
        )  # agreed: the gathered table and the verdict
        if by_grad:
            live = [r for r in rows if r.tokens > 0]
            norms = sample_grad_norms(self._model, params, self._tap, located, live, self._args)
            culprits = grad_outliers(live, norms, zscore=self.cfg.zscore, min_rel=self.cfg.min_rel)
            # agreed: the gathered culprits, and whether the rows carry the snapshot's losses (`confirm_at_snapshot`)
            if culprits and any(math.isfinite(r.loss_snapshot) for r in live):
                culprits, weights = confirm_at_snapshot(
                    self._model,
                    self._optimizer,
                    store,
                    params,
                    self._tap,
                    located,
                    live,
                    culprits,
                    norms,
                    zscore=self.cfg.zscore,
                    min_rel=self.cfg.min_rel,
                    args=self._args,
                )
                suspects = suspects + weights
            if culprits and all_reduce_flag(self._weights_suspect()):  # entered by every rank: culprits are agreed
                # the run's weights went bad (restored with the LR backed off, or a monitor saw a too-high LR's
                # signs): a gradient outlier now is the weights' doing; the loss rules still name records
                suspects, culprits = suspects + [c.row for c in culprits], []
        if self.cfg.screen and self._tap is not None:  # agreed: the gathered rows and the config
            inputs = {(step, rid): (self._tap.inputs[mb][1], seg) for rid, (mb, seg) in located.items()}
            culprits += [c for _, c in self._prompt_mismatches({step: (rows, culprits, med)}, inputs)]
        culprits = sorted(culprits, key=lambda c: -c.row.z)[: self.cfg.max_culprits]
        culprits = [c for c in culprits if c.row.record_id not in self.quarantine]
        if self.cfg.grad_norms and culprits and params is not None and not by_grad and engine.can_rerun:
            culprit_grad_norms(self._model, params, self._tap, located, culprits, self._args)
        live = [r for r in rows if r.tokens > 0]
        top = sorted(
            zip(live, ratios(live), strict=False),
            key=lambda rx: -rx[0].loss if math.isfinite(rx[0].loss) else -math.inf,
        )
        self.event(
            step,
            "step_forensics",
            f"step {step} ({', '.join(step_reasons)}): {len(rows)} samples re-run, median loss {med:.4g}; "
            f"{len(culprits)} culprit(s)"
            + (f", {len(suspects)} fine at the snapshot's weights (the weights, not the data)" if suspects else ""),
            severity="info",
            step_median=med,
            step_reasons=step_reasons,
            samples=[[_where(self.records, r.record_id)[0], _num(r.loss), _num(x), _num(r.z)] for r, x in top[:32]],
            healthy=[_num(x) for x in list(self._reference)[-256:]],
        )
        self._quarantine(step, culprits, med, step_reasons)
        self.forensics_seconds += time.perf_counter() - started  # logged (rank 0): not an event, ranks' times differ

    def _weights_suspect(self) -> bool:
        """This rank has seen the weights go bad: a rollback restored them and backed the LR off (`LRControl`'s
        persistent `rollback` factor below 1), or a monitor raised one of a too-high LR's signs (`LR_SIGNS`: e.g.
        saturated attention logits). Monitors judge per rank: the caller agrees on it over ranks."""
        control = getattr(self._rollback, "lr_control", None)
        if control is not None and control.factor("rollback") < 1.0:
            return True
        return any(e["kind"] in LR_SIGNS for cb in self._monitors for e in cb.events)

    # --- the quarantine ------------------------------------------------------------------------------------
    def _quarantine(self, step: int, culprits: list[Culprit], median: float, step_reasons: list[str], at=None) -> None:
        """`at`: (epoch, position) the entries apply from; default the sampler's (agreed over ranks)."""
        if not culprits:
            return
        if at is None:
            position = float(self.sampler.position) if self.sampler is not None else 0.0
            pos = torch.tensor([position], dtype=torch.float64)
            position = int(all_reduce_tensor(pos, "max").item())  # entered by every rank: the culprit list is agreed
            epoch = self.sampler.epoch if self.sampler is not None else 0
        else:
            epoch, position = at
        names = []
        for c in culprits:
            where, digest, preview = _where(self.records, c.row.record_id)
            evidence = {
                "loss": c.row.loss,
                "z": c.row.z,
                "tokens": c.row.tokens,
                "step_median": median,
                "loss_at_snapshot": c.row.loss_snapshot,
                "grad_norm": c.grad_norm,
                "prompt_gain": c.prompt_gain,
                "step_reasons": step_reasons,
            }
            evidence.update(c.detail)
            evidence = {k: _num(v) if isinstance(v, float) else v for k, v in evidence.items()}
            entry = Entry(
                record_id=c.row.record_id,
                where=where,
                hash=digest,
                step=step,
                reason=c.reason,
                preview=preview,
                evidence=evidence,
                epoch=epoch,
                position=position,
            )
            if self.quarantine.add(entry):
                told = (
                    f"compresses to {c.detail['compression']:.3g}"
                    if "compression" in c.detail
                    else f"loss {c.row.loss:.4g}, z {c.row.z:.3g}"
                    + (f", prompt gain {c.prompt_gain:.3g}" if math.isfinite(c.prompt_gain) else "")
                )
                names.append(f"{where} ({c.reason}, {told})")
        if names:
            action = (
                "never sampled again" if self.cfg.quarantine == "auto" else "reported only (data.quarantine: report)"
            )
            self.event(
                step,
                "samples_quarantined",
                f"step {step}: {len(names)} record(s) quarantined, {action}: "
                + "; ".join(names[:MAX_LISTED])
                + (f"; +{len(names) - MAX_LISTED} more (all in quarantine.jsonl)" if len(names) > MAX_LISTED else ""),
                severity="warning",
                records=[e.to_dict() for e in self.quarantine.entries if e.step == step],
            )


def build_forensics(data_cfg, records, callbacks) -> list:
    """``[SpikeForensics]`` wired to the guards in `callbacks`, or ``[]`` with ``data.quarantine: off``."""
    cfg = ForensicsConfig.from_data(data_cfg)
    if cfg.quarantine == "off":
        return []
    return [SpikeForensics(cfg, records).attach(callbacks)]


def wrap_train_sampler(trainer, sampler, dataset):
    """`sampler` wrapped in a `QuarantineSampler` when the trainer has an enabled ``auto`` `SpikeForensics` and the
    dataset carries ``record_id``; else `sampler` unchanged. Called from `StableTrainer._get_train_sampler`."""
    forensics = next(
        (cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SpikeForensics) and cb.enabled), None
    )
    if forensics is None or sampler is None or forensics.cfg.quarantine != "auto":
        return sampler
    if "record_id" not in (getattr(dataset, "column_names", None) or []):
        return sampler
    args = trainer.args
    seed = args.data_seed if args.data_seed is not None else args.seed
    forensics.sampler = QuarantineSampler(sampler, forensics.quarantine, dataset["record_id"], seed=seed)
    return forensics.sampler
