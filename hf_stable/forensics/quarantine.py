"""The quarantine: records named as culprits of bad steps, written to ``quarantine.jsonl`` and (``auto``) never
sampled again - on every rank, and after a resume.

Every entry carries the sampler position from which it applies: (epoch, position in that epoch's permutation).
Why: on resume the Trainer regenerates the epoch's permutation and skips the batches already consumed. A filter
over the whole permutation would shorten the consumed prefix by the culprits it held and shift every later batch;
a filter that only applies from the position the sampler had reached when the culprit was named yields exactly
the sequence the uninterrupted run yielded, so kill -9 + resume stays bitwise equal. From the next epoch on the
record is simply left out.

`QuarantineSampler` wraps the Trainer's train sampler (`callbacks.spike_forensics.wrap_train_sampler`, one line in
`StableTrainer._get_train_sampler`). The permutation itself must not depend on the global RNG (a resume restores
it at another point): a plain `RandomSampler` is replaced by a seeded one (seed + epoch), as accelerate's
`SeedableRandomSampler` does for a sampler it can see (it cannot see through the wrapper).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils.data import RandomSampler, Sampler

QUARANTINE_FILE = "quarantine.jsonl"


@dataclass
class Entry:
    """One quarantined record: which, why, with what evidence, and from which sampler position on."""

    record_id: int
    where: str
    hash: str
    step: int
    reason: str
    preview: str = ""
    evidence: dict = field(default_factory=dict)
    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Quarantine:
    """The run's quarantined records (the same list on every rank: built from gathered, rank-agreed values).

    Args:
        mode: ``"auto"`` (the sampler leaves them out), ``"report"`` (file only) or ``"off"``.
        output_dir: where ``quarantine.jsonl`` is written (main process only).
    """

    def __init__(self, mode: str = "auto", output_dir: str | None = None):
        self.mode = mode
        self.output_dir = output_dir
        self.entries: list[Entry] = []
        self._ids: set[int] = set()

    def __contains__(self, record_id: int) -> bool:
        return record_id in self._ids

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: Entry, *, write: bool = True) -> bool:
        """Add `entry` unless its record is already in; append it to the file when `write`. Returns True if new."""
        if entry.record_id in self._ids:
            return False
        self.entries.append(entry)
        self._ids.add(entry.record_id)
        if write and self.output_dir:
            path = Path(self.output_dir)
            path.mkdir(parents=True, exist_ok=True)
            with open(path / QUARANTINE_FILE, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry.to_dict(), ensure_ascii=False) + "\n")
        return True

    def rewrite(self) -> None:
        """Make ``quarantine.jsonl`` hold exactly `entries` (atomic): after a resume, entries named after the
        checkpoint are dropped - the resumed run names them again."""
        if not self.output_dir:
            return
        path = Path(self.output_dir) / QUARANTINE_FILE
        if not self.entries and not path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{QUARANTINE_FILE}.tmp")
        tmp.write_text("".join(json.dumps(e.to_dict(), ensure_ascii=False) + "\n" for e in self.entries), "utf-8")
        tmp.replace(path)

    def blocks(self, record_id: int, epoch: int, position: int) -> bool:
        """True when the sampler must not yield `record_id` at (`epoch`, `position`) (``auto`` only)."""
        if self.mode != "auto" or record_id not in self._ids:
            return False
        for e in self.entries:
            if e.record_id == record_id:
                return epoch > e.epoch or (epoch == e.epoch and position >= e.position)
        return False

    def state_dict(self) -> dict:
        return {"entries": [e.to_dict() for e in self.entries]}

    def load_state_dict(self, state: dict) -> None:
        self.entries, self._ids = [], set()
        for d in state.get("entries", []):
            self.add(Entry(**d), write=False)


def read_quarantine(path: str | Path) -> list[dict]:
    """The entries of a ``quarantine.jsonl`` (empty when there is none)."""
    p = Path(path)
    if p.is_dir():
        p = p / QUARANTINE_FILE
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


class QuarantineSampler(Sampler):
    """Yields the base sampler's indices, minus the quarantined records from the position they were named at.

    Args:
        base: the Trainer's train sampler (indices into the train dataset).
        quarantine: the run's `Quarantine` (read at every step of the iteration: entries added mid-epoch apply).
        record_ids: the dataset's ``record_id`` column (dataset row -> record id).
        seed: seeds the permutation when `base` is a plain `RandomSampler` (then ``seed + epoch``).
    """

    def __init__(self, base, quarantine: Quarantine, record_ids: list[int], seed: int = 0):
        self.base = base
        self.quarantine = quarantine
        self.record_ids = list(record_ids)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0  # base positions consumed in the current iteration
        self._seeded = type(base) is RandomSampler and base.generator is None and not base.replacement

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.base, "set_epoch"):
            self.base.set_epoch(epoch)

    def _base_indices(self):
        if self._seeded:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            yield from torch.randperm(len(self.base.data_source), generator=g).tolist()
        else:
            yield from self.base

    def __iter__(self):
        self.position = 0
        for pos, idx in enumerate(self._base_indices()):
            self.position = pos + 1
            if self.quarantine.blocks(self.record_ids[idx], self.epoch, pos):
                continue
            yield idx

    def __len__(self) -> int:
        # The base length: the Trainer plans epochs from it before a resumed quarantine is loaded, so it must not
        # change with the quarantine (an epoch that yields fewer indices simply ends a little early).
        return len(self.base)
