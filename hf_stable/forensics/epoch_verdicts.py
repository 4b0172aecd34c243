"""`EpochVerdicts`: the end-of-epoch half of `SpikeForensics` - the trajectory rule's verdicts
(`hf_stable.forensics.trajectory`) turned into quarantine entries that apply from the next epoch on."""

from __future__ import annotations

import math
import time

import torch

from hf_stable.forensics.attribution import Culprit, SampleRow
from hf_stable.forensics.sample_loss import (
    answer_row_fn,
    chunk_answer_stats,
    chunk_sample_loss,
    per_sample_answer_stats,
    per_sample_loss,
)
from hf_stable.forensics.token_prefixes import fit_to_vocab, prefix_table, special_ids, text_mask
from hf_stable.forensics.trajectory import TrajectoryTable


class EpochVerdicts:
    """Mixin of `SpikeForensics` (which provides `trajectory`, `quarantine`, `cfg`, `_quarantine`, `_model`)."""

    trajectory = None
    _epochs_judged = 0  # epochs whose end the trajectory rule has judged
    trajectory_seconds = 0.0  # the trajectory's own work (in perf/forensics_screen_s too), perf/forensics_trajectory_s
    _prefixes = None  # [V, K] token ids spelling a prefix of each token (token_prefixes), on the logits' device
    _prefix_source = None  # the tokenizer's table (CPU) until the first forward tells the vocabulary size
    _special = None  # the tokenizer's special token ids (CPU); _text: [V] bool, the answer-text tokens (device)
    _text = None
    _answer_rows = None  # with trajectories: the row function the chunked loss runs on its chunks (sample_loss)

    def _init_trajectory(self, cfg, records) -> None:
        self.trajectory = None
        if cfg.screen and cfg.trajectory:
            self.trajectory = TrajectoryTable(len(records or []), cfg.trajectory_sightings, cfg.trajectory_max_records)
            self._answer_rows = answer_row_fn(self._fit_tables)
        self._epochs_judged = 0

    def _trajectory_state(self) -> dict:
        table = self.trajectory.state_dict() if self.trajectory is not None else {}
        return {"trajectory": table, "epochs_judged": self._epochs_judged}

    def _load_trajectory_state(self, state: dict) -> None:
        if self.trajectory is not None:
            self.trajectory.load_state_dict(state.get("trajectory") or {})
        self._epochs_judged = int(state.get("epochs_judged", 0))

    def _init_token_prefixes(self, tokenizer) -> None:
        """The run's tokenizer (the Trainer's `processing_class`): which tokens spell a prefix of which, and which
        are special (not answer text). Without one every supervised position is scored by its gold token alone."""
        used = self.trajectory is not None and tokenizer is not None
        self._prefix_source = prefix_table(tokenizer) if used else None
        self._special = special_ids(tokenizer) if used else None
        self._prefixes = self._text = None

    def _sample_losses(self, kwargs, source, record_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Screening's per-sample (loss, supervised-token count) of a training forward (on device, no sync) from its
        logits or a chunked loss's `ChunkedLoss`; with trajectories, from the same pass that buffers the table's
        values."""
        if self.trajectory is not None:
            return self._observe_trajectory(kwargs, source, record_ids)
        if isinstance(source, torch.Tensor):
            return per_sample_loss(source, kwargs["labels"], kwargs.get("position_ids"), len(record_ids))
        return chunk_sample_loss(source, kwargs["labels"], kwargs.get("position_ids"), len(record_ids))

    def _fit_tables(self, vocab: int, device) -> torch.Tensor | None:
        """The prefix table (returned) and text mask, fitted to the logits' vocabulary once."""
        if self._prefixes is None and self._prefix_source is not None:
            self._prefixes = fit_to_vocab(self._prefix_source, vocab, device)
        if self._text is None and self._special is not None:
            self._text = text_mask(self._special, vocab, device)
        return self._prefixes

    def _observe_trajectory(self, kwargs, source, record_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """One training forward's per-sample values into the table's buffer; returns (loss, count)."""
        started = time.perf_counter()
        where = (kwargs["labels"], kwargs.get("position_ids"), len(record_ids))
        if isinstance(source, torch.Tensor):
            prefixes = self._fit_tables(source.shape[-1], source.device)
            loss, count, nats, first, margin = per_sample_answer_stats(source, *where, prefixes, self._text)
        else:  # the chunks ran `_answer_rows`, which fitted the tables
            loss, count, nats, first, margin = chunk_answer_stats(source, self._answer_rows, *where, self._text)
        self.trajectory.observe(self._step, record_ids, loss, count, nats, first, margin)
        self.trajectory_seconds += time.perf_counter() - started
        return loss, count

    def _flush_trajectory(self) -> None:
        """Gather the buffered rows into the table (every rank, at the screening's decision steps)."""
        if self.trajectory is not None:
            started = time.perf_counter()
            self.trajectory.flush(self._device())
            self.trajectory_seconds += time.perf_counter() - started

    def on_epoch_begin(self, args, state, control, **kwargs):
        # a run resumed from a checkpoint written at an epoch's last step (saved before that epoch's end was
        # judged) judges it now: the same table, the same step, the same entries as the uninterrupted run
        if self.enabled and self.trajectory is not None and self._epochs_judged < int((state.epoch or 0) + 1e-6):
            self._judge_trajectories(state.global_step, int((state.epoch or 0) + 1e-6))

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.enabled and self.trajectory is not None:
            self._judge_trajectories(state.global_step, max(self._epochs_judged + 1, int((state.epoch or 0) + 1e-6)))

    def _judge_trajectories(self, step: int, epochs_done: int) -> None:
        """Name the records whose trajectory stands out (rank-agreed: the gathered table); they apply from the next
        epoch on (entry epoch = the epoch judged, position past its end)."""
        started = time.perf_counter()
        self.trajectory.flush(self._device())
        verdicts = self.trajectory.judge(
            min_sightings=self.cfg.trajectory_min_sightings,
            zscore=self.cfg.trajectory_zscore,
            gain_weight=self.cfg.trajectory_gain_weight,
            min_population=self.cfg.trajectory_min_population,
            exclude=self.quarantine,
            early_zscore=self.cfg.trajectory_early_zscore,
        )
        culprits = [
            Culprit(
                SampleRow(
                    v.record_id,
                    v.evidence["losses"][-1],
                    int(self.trajectory.tokens[v.record_id]),
                    math.nan,
                    0,
                    v.score,
                ),
                "trajectory",
                detail=v.evidence,
            )
            for v in verdicts
        ]
        epoch = epochs_done - 1
        self._epochs_judged = epochs_done
        self._quarantine(step, culprits, math.nan, ["trajectory", f"epoch {epoch}"], at=(epoch, 2**31 - 1))
        self.screen_seconds += time.perf_counter() - started
        self.trajectory_seconds += time.perf_counter() - started

    def _device(self):
        return next(self._model.parameters()).device if self._model is not None else torch.device("cpu")
