"""Record identity: every training sample can be named by the JSONL line it came from.

`RecordTable` is built where the records are read: record id (its index in the table) -> source ``file:line``,
a content hash and a short cleaned preview. The id then travels as a ``record_id`` column through tokenization,
padding and packing to the batch (``record_ids``: one per row when padded, one per segment when packed, in the
order of the ``position_ids`` restarts, -1 for a tail padding segment). `StableTrainer` takes it out of the
inputs before the model's forward, so the model never sees it; the forensics read it to name the culprits of a
bad step.

The content hash is over the record's canonical JSON (sorted keys) *after* cleaning, so the same record in a
copied or reordered file keeps its hash: a quarantine file from one run excludes the same data from another
(`data.exclude_file`), by ``file:line`` or by hash.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from hf_stable.data.prompts import answer_text
from hf_stable.errors import DataError

PREVIEW_CHARS = 80
# a degenerate answer: at least this long and compressing to under this fraction of its UTF-8 size (one character
# or a short phrase repeated; ordinary prose compresses to ~0.4-0.6, repetitive code or tables to ~0.2)
DEGENERATE_MIN_CHARS = 64
DEGENERATE_MAX_RATIO = 0.1


def record_hash(obj: dict) -> str:
    """16 hex digits of sha256 over the record's canonical JSON (sorted keys, no whitespace)."""
    canonical = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def record_preview(obj: dict, limit: int = PREVIEW_CHARS) -> str:
    """A one-line preview of the record: the prompt's start, then the answer's start (control chars dropped)."""
    if "messages" in obj:
        prompt = " ".join(m.get("content", "") for m in obj["messages"][:-1])
    else:
        prompt = " ".join(x for x in (obj.get("instruction", ""), obj.get("input") or "") if x)
    text = f"{prompt.strip()} => {answer_text(obj).strip()}"
    text = "".join(c if c.isprintable() else " " for c in text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def compression_ratio(text: str) -> float:
    """zlib-compressed size over the UTF-8 size of `text` (1.0 for an empty text)."""
    raw = text.encode("utf-8", "surrogatepass")
    return len(zlib.compress(raw, 9)) / len(raw) if raw else 1.0


def degenerate_answer(obj: dict) -> float | None:
    """The compression ratio of the record's answer when it is degenerate (a repetition filter in the manner of
    the Gopher rules, Rae et al. 2021), else None."""
    text = answer_text(obj)
    if len(text) < DEGENERATE_MIN_CHARS:
        return None
    ratio = compression_ratio(text)
    return ratio if ratio < DEGENERATE_MAX_RATIO else None


@dataclass(frozen=True)
class RecordInfo:
    """Where one record came from: ``file:line``, content hash, preview."""

    where: str
    hash: str
    preview: str

    def to_dict(self) -> dict:
        return {"where": self.where, "hash": self.hash, "preview": self.preview}


class RecordTable:
    """Record id -> `RecordInfo` for the records of one run (ids are indices, in file order).

    Example:
        >>> table = RecordTable.from_records(read.records)
        >>> table[3].where
        'train.jsonl:4'
    """

    def __init__(
        self,
        infos: list[RecordInfo] | None = None,
        empty_prompt: list[int] | None = None,
        degenerate: dict[int, float] | None = None,
    ):
        self.infos: list[RecordInfo] = list(infos or [])
        self.degenerate: dict[int, float] = dict(degenerate or {})  # record id -> compression ratio of its answer
        # token ids of the prompt template around an empty question: the context of the screening's
        # "does the prompt explain the answer" re-run (`hf_stable.forensics.attribution.prompt_gain`)
        self.empty_prompt: list[int] = list(empty_prompt or [])

    @classmethod
    def from_records(cls, records, empty_prompt: list[int] | None = None) -> RecordTable:
        records = list(records)
        degenerate = {k: x for k, r in enumerate(records) if (x := degenerate_answer(r.data)) is not None}
        infos = [RecordInfo(r.where, record_hash(r.data), record_preview(r.data)) for r in records]
        return cls(infos, empty_prompt, degenerate)

    def __len__(self) -> int:
        return len(self.infos)

    def __getitem__(self, record_id: int) -> RecordInfo:
        return self.infos[record_id]

    def get(self, record_id: int) -> RecordInfo | None:
        return self.infos[record_id] if 0 <= record_id < len(self.infos) else None


def read_exclusions(source) -> set[str]:
    """The ``file:line`` names and content hashes listed by `source`.

    `source` is a path to a quarantine file (JSON lines with ``where`` and/or ``hash``, as written by the
    quarantine) or a plain text file (one ``file:line`` or hash a line, ``#`` comments), or a list of such
    strings.

    Raises:
        DataError: the file does not exist, or a JSON line names neither ``where`` nor ``hash`` (file:line).
    """
    if source is None:
        return set()
    if isinstance(source, (list, tuple, set)):
        return {str(x).strip() for x in source if str(x).strip()}
    path = Path(source)
    if not path.is_file():
        raise DataError(
            f"data.exclude_file: {source} does not exist (a quarantine.jsonl or a list of file:line / hashes)"
        )
    out: set[str] = set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{source}:{lineno}: malformed JSON ({e.msg}); data.exclude_file wants a "
                    "quarantine.jsonl or one file:line / hash a line"
                ) from None
            names = [obj.get(k) for k in ("where", "hash") if isinstance(obj.get(k), str)]
            if not names:
                raise DataError(f"{source}:{lineno}: names neither 'where' (file:line) nor 'hash'")
            out.update(names)
        else:
            out.add(line)
    return out


def is_excluded(info: RecordInfo, exclusions: set[str]) -> bool:
    """True when the record's ``file:line`` (or just ``name:line``) or its content hash is listed."""
    if not exclusions:
        return False
    if info.hash in exclusions or info.where in exclusions:
        return True
    path, _, line = info.where.rpartition(":")
    return f"{Path(path).name}:{line}" in exclusions


def exclude_records(read, exclusions: set[str]) -> int:
    """Drop the records of `read` (a `ReadResult`) that `exclusions` names; counted as ``excluded`` among its
    skipped reasons, so the audit and the data stats show them. Returns how many were dropped."""
    if not exclusions:
        return 0
    kept = [r for r in read.records if not is_excluded(RecordInfo(r.where, record_hash(r.data), ""), exclusions)]
    n = len(read.records) - len(kept)
    if n:
        read.records = kept
        read.skipped["excluded"] += n
    return n
