"""Which records the recipe evaluates on when ``data.eval_file`` is ``auto``.

Why: a user who sets only ``data.train_file`` would otherwise be evaluated on the packaged embedded set, a task
their model was never trained for (an eval loss and an exact match that say nothing about their data). So
``auto`` means the embedded eval set for the embedded train set, and for any other train file a seeded held-out
split of that file's good records: the same records for the same file and seed on every rank and on resume, left
out of training, said in one console line.

The split is taken before ``data.exclude_file`` leaves records out, so quarantining a record later does not move
other records between train and eval.
"""

from __future__ import annotations

import random
from dataclasses import replace

from hf_stable.data.records import ReadResult
from hf_stable.resources import embedded_dataset_name

AUTO = "auto"
EMBEDDED_EVAL = "embedded:eval"


def holdout_size(n_records: int, fraction: float, max_records: int) -> int:
    """Records held out of `n_records`: `fraction` of them (at least 1), at most `max_records`, and never so many
    that fewer than half are left to train on (0 for a file of one record: nothing can be spared)."""
    if n_records < 2 or fraction <= 0 or max_records <= 0:
        return 0
    return max(1, min(max_records, round(n_records * fraction), n_records // 2))


def resolve_eval_file(train_file: str, eval_file: str | None) -> str | None:
    """What ``data.eval_file`` names once ``auto`` is resolved: the embedded eval set for an embedded train set,
    ``auto`` (a held-out split) for the user's own file, otherwise the value as given (None: no evaluation)."""
    if eval_file != AUTO:
        return eval_file
    return EMBEDDED_EVAL if embedded_dataset_name(train_file) is not None else AUTO


def split_holdout(read: ReadResult, *, fraction: float, max_records: int, seed: int) -> tuple[ReadResult, ReadResult]:
    """Split the good records of `read` into (train, eval) `ReadResult`s; eval keeps file order.

    The train part keeps the file's counts of bad / blank lines (they happened while reading it); the eval part
    counts only its own records.
    """
    n_eval = holdout_size(len(read.records), fraction, max_records)
    held = set(random.Random(seed).sample(range(len(read.records)), n_eval))
    train = replace(read, records=[r for i, r in enumerate(read.records) if i not in held])
    held_records = [r for i, r in enumerate(read.records) if i in held]
    evals = ReadResult(records=held_records, format=read.format, n_lines=len(held_records))
    return train, evals
