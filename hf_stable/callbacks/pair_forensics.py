"""`PairForensics`: a skipped DPO / KTO step names the records it trained on.

`hf_stable.stabilize` tags a preference trainer's dataset (`forensics.pairs.tag_records`): every batch carries its
rows' indices in the dataset the user passed, and the step's `StepTap` keeps them per micro-batch. When the skip
guard skips a step (its verdict is the same on every rank), every rank's indices are gathered
(`distributed.all_gather_rows`, entered by every rank on that agreed verdict) and the main process writes

* a ``step_pairs`` event (info: the detail of the ``step_skipped`` warning): the step, the skip's reasons, the
  records' indices (and ``file:line`` when the user said where they came from: ``stabilize(trainer, records=...)``);
* one line per record in ``skipped_pairs.jsonl``: step, index, where, the skip's reasons and the record's text
  (prompt / chosen / rejected, cut), so the user can open the pairs behind the step.

No cost on healthy steps: the ids are collated with the batch and read only on a skipped step.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.core.step_tap import StepTap
from hf_stable.distributed import all_gather_rows
from hf_stable.forensics.pairs import PAIR_COLUMN, preview, record_places

PAIRS_FILE = "skipped_pairs.jsonl"
MAX_LISTED = 8  # indices named in the message; the event and the file keep them all


class PairForensics(StabilityCallback):
    """Names the records of every skipped preference step; event ``step_pairs``, file ``skipped_pairs.jsonl``.

    Args:
        trainer: the (tagged) TRL trainer; its train dataset gives each record's text.
        records: where each record index came from: a JSONL path or one ``where`` string per index (optional).

    Example:
        >>> PairForensics(trainer, records="pairs.jsonl").attach(skip_guard)  # `hf_stable.stabilize` does this
    """

    def __init__(self, trainer, records=None):
        super().__init__(True)
        self._trainer_ref = weakref.ref(trainer)  # the trainer holds this callback
        self._places = record_places(records)
        self._rows: dict[int, int] | None = None  # record index -> processed dataset row (built on first use)

    def attach(self, skip_guard) -> PairForensics:
        skip_guard.add_listener(self._on_verdict)
        return self

    def _step_ids(self) -> list[int]:
        """Every rank's record indices of the step's micro-batches (the same list on every rank)."""
        model = self._trainer_ref().model
        tap = StepTap.shared(model)
        local = [ids.reshape(-1).to("cpu", torch.long) for ids in tap.record_ids if isinstance(ids, torch.Tensor)]
        flat = torch.cat(local) if local else torch.zeros(0, dtype=torch.long)
        device = next(model.parameters()).device
        rows = all_gather_rows(flat.to(device).reshape(-1, 1), fill=-1)
        return [int(i) for i in rows.reshape(-1).tolist() if i >= 0]

    def _where(self, index: int) -> str | None:
        return self._places[index] if self._places is not None and 0 <= index < len(self._places) else None

    def _record(self, index: int) -> dict:
        ds = self._trainer_ref().train_dataset
        if self._rows is None:
            self._rows = {int(r): i for i, r in enumerate(ds[PAIR_COLUMN])}
        row = self._rows.get(index)
        return preview(ds[row]) if row is not None else {}

    def _on_verdict(self, verdict) -> None:
        if not self.enabled or not verdict.skip:
            return
        ids = self._step_ids()  # every rank: the verdict is agreed
        if not ids:
            return
        places = [self._where(i) for i in ids]
        named = [p or f"record {i}" for i, p in zip(ids, places, strict=True)]
        more = f" and {len(ids) - MAX_LISTED} more" if len(ids) > MAX_LISTED else ""
        message = (
            f"step {verdict.step} skipped ({', '.join(verdict.reasons)}): it trained on {len(ids)} records: "
            f"{', '.join(named[:MAX_LISTED])}{more} (index in the train dataset; text in {PAIRS_FILE}). When the data "
            "caused it (a loss spike on one batch usually is), look there for a pair with chosen and rejected swapped, "
            "a broken or duplicated completion, or a prompt that does not fit"
        )
        self.event(
            verdict.step,
            "step_pairs",
            message,
            records=ids,
            where=places if self._places is not None else None,
            reasons=list(verdict.reasons),
            file=PAIRS_FILE,
            severity="info",  # the detail of the step_skipped warning, not a second alert
        )
        if self._is_main and self._output_dir is not None:
            path = Path(self._output_dir) / PAIRS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                for i, where in zip(ids, places, strict=True):
                    line = {"step": verdict.step, "index": i, "where": where, "reasons": list(verdict.reasons)}
                    f.write(json.dumps({**line, **self._record(i)}, ensure_ascii=False) + "\n")
