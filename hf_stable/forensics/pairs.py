"""Which preference records (DPO pairs, KTO examples) a TRL step trained on, so a skipped step can name them.

TRL's `DPOTrainer` / `KTOTrainer` tokenize and filter the user's dataset in their ``__init__`` (a ``map`` keeps the
text columns and adds ``prompt_ids`` ...; a ``filter`` drops the rows whose prompt alone fills ``max_length``, leaving
an index mapping). `tag_records` (called by `hf_stable.stabilize`) adds a ``hf_stable_record`` column to that
processed dataset: each row's index in the dataset the user passed (read through the filter's mapping,
`compat.dataset_source_rows`), keeps the column through the Trainer's unused-column removal
(`compat.keep_train_column`) and wraps the collator (`PairIdsCollator`) so every batch carries its rows' indices as
``record_ids``. `StableTrainer.compute_loss` takes them out before TRL sees the batch and hands them to the step's
`StepTap`; the `PairForensics` callback names them when the step is skipped.

``records`` (``stabilize(trainer, records=...)``) says where each index came from: the JSONL file the dataset was
read from (index ``i`` is its ``i``-th non-empty line) or one ``where`` string per index (``"pairs.jsonl:12"``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_stable.core.step_tap import RECORD_IDS_KEY

PAIR_COLUMN = "hf_stable_record"
PREVIEW_CHARS = 120


class PairIdsCollator:
    """Wraps a TRL collator: takes ``hf_stable_record`` out of each example and returns the batch with
    ``record_ids`` (``[B]`` int64, -1 for an example without it) when `return_record_ids` is set (`StableTrainer`
    sets it and takes the key out again before the forward). Every other key reaches `inner` unchanged."""

    def __init__(self, inner):
        self.inner = inner
        self.return_record_ids = False

    def __call__(self, features, *args, **kwargs):
        ids, tagged = [], False
        if isinstance(features, list) and features and all(isinstance(f, dict) for f in features):
            features = [dict(f) for f in features]  # the dataset's rows stay as they are
            for f in features:
                tagged |= PAIR_COLUMN in f
                ids.append(int(f.pop(PAIR_COLUMN, -1)))
        batch = self.inner(features, *args, **kwargs)
        if tagged and self.return_record_ids and isinstance(batch, dict):
            batch[RECORD_IDS_KEY] = torch.tensor(ids, dtype=torch.long)
        return batch

    def __getattr__(self, name):  # the inner collator's attributes (pad_token_id ...) as before
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def tag_records(trainer) -> bool:
    """Add the record-index column to `trainer`'s processed train dataset and wrap its collator (see the module
    docstring); False (nothing changed) when the dataset is not a `datasets.Dataset` or already tagged."""
    from hf_stable.compat import dataset_source_rows, keep_train_column

    ds = getattr(trainer, "train_dataset", None)
    names = getattr(ds, "column_names", None)
    if names is None or not hasattr(ds, "add_column") or PAIR_COLUMN in names:
        return False
    trainer.train_dataset = ds.add_column(PAIR_COLUMN, dataset_source_rows(ds))
    keep_train_column(trainer, PAIR_COLUMN)
    if not isinstance(trainer.data_collator, PairIdsCollator):
        trainer.data_collator = PairIdsCollator(trainer.data_collator)
    return True


def record_places(records) -> list[str] | None:
    """`records` as one ``where`` per record index: a JSONL path -> ``name:line`` of its non-empty lines; a
    sequence of strings as given; None -> None."""
    if records is None:
        return None
    if isinstance(records, str | Path):
        path = Path(records)
        with path.open(encoding="utf-8") as f:
            return [f"{path.name}:{n}" for n, line in enumerate(f, 1) if line.strip()]
    return [str(r) for r in records]


def preview(row: dict) -> dict:
    """The text of a processed dataset row (prompt / chosen / rejected, or prompt / completion / label), cut to
    `PREVIEW_CHARS` characters each."""
    out = {}
    for key in ("prompt", "chosen", "rejected", "completion", "label"):
        if key in row:
            v = row[key]
            out[key] = v if isinstance(v, bool | int | float) or v is None else str(v)[:PREVIEW_CHARS]
    return out
