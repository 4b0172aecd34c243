"""Reading JSONL records (alpaca or chat) with every bad line named by file:line.

Why our own line reader instead of ``datasets.load_dataset("json")``: the Arrow JSON reader fails on
the first bad line with a message that names neither the file nor the line, and it cannot skip and
count. Here every line is decoded (strict UTF-8), parsed and schema-checked on its own, so the user
gets ``train.jsonl:1234: field 'output' must be a string, got int`` — or, with
``data.on_bad_record: skip``, the line is skipped and counted by reason for the audit. The good
records then become a ``datasets.Dataset`` (see ``bundle.py``).

Accepted records:
    alpaca: ``{"instruction": str, "input": str | null (optional), "output": str, ...extra keys}``
    chat:   ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...], ...}``
            where the last message is the assistant answer to learn.
Blank lines are ignored (and counted); a UTF-8 BOM at the start of the file is dropped.

Also bad (an error naming file:line, or skipped and counted by reason): a string holding a lone UTF-16
surrogate (``"\\ud800"`` is valid JSON but not Unicode text, and tokenizers reject it), and a record whose
answer is empty after cleaning (only whitespace, zero-width or control characters), which would otherwise be
trained as "answer: EOS".
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hf_stable.data.cleaning import CleaningStats, clean_record
from hf_stable.data.prompts import answer_text
from hf_stable.errors import DataError
from hf_stable.resources import data_file, embedded_data_paths

ROLES = ("system", "user", "assistant", "tool")
_MAX_EXAMPLES = 20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a surrogate gets into valid UTF-8 JSON text


@dataclass
class Record:
    """One good record, cleaned, with where it came from."""

    data: dict
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class ReadResult:
    """The good records of one file plus what happened to the rest.

    Attributes:
        records: good (cleaned) records in file order.
        format: ``"alpaca"`` or ``"chat"``.
        n_lines: non-blank lines seen.
        skipped: reason -> count of bad lines skipped (only with ``on_bad_record="skip"``).
        skipped_examples: the first messages of skipped lines, ``file:line: what is wrong``.
        cleaning: per-field cleaning counts.
    """

    records: list[Record]
    format: str
    n_lines: int = 0
    n_blank: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_examples: list[str] = field(default_factory=list)
    cleaning: CleaningStats = field(default_factory=CleaningStats)


class BadRecord(Exception):
    """One bad line: `reason` is the counter key of the skip-and-count mode, the message says what is wrong."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def record_format(obj: dict) -> str | None:
    """``"chat"`` if the record has ``messages``, ``"alpaca"`` if it has ``instruction`` or ``output``."""
    if "messages" in obj:
        return "chat"
    if "instruction" in obj or "output" in obj:
        return "alpaca"
    return None


def check_alpaca(obj: dict) -> dict:
    for name in ("instruction", "output"):
        if name not in obj:
            raise BadRecord("missing_field", f"missing field '{name}' (alpaca records need instruction, output)")
        if not isinstance(obj[name], str):
            raise BadRecord("wrong_type", f"field '{name}' must be a string, got {_type_name(obj[name])}")
    if obj.get("input") is None:
        obj = {**obj, "input": ""}
    elif not isinstance(obj["input"], str):
        raise BadRecord("wrong_type", f"field 'input' must be a string or null, got {_type_name(obj['input'])}")
    return obj


def check_message_items(msgs: list, name: str) -> None:
    """Each message of the list `name` is an object with string `role` (one of `ROLES`) and `content`."""
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRecord("wrong_type", f"{name}[{i}] must be an object, got {_type_name(m)}")
        for key in ("role", "content"):
            if key not in m:
                raise BadRecord("missing_field", f"{name}[{i}] has no '{key}'")
            if not isinstance(m[key], str):
                raise BadRecord("wrong_type", f"{name}[{i}].{key} must be a string, got {_type_name(m[key])}")
        if m["role"] not in ROLES:
            raise BadRecord("bad_messages", f"{name}[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}")


def check_chat(obj: dict) -> dict:
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        raise BadRecord("wrong_type", f"field 'messages' must be a list, got {_type_name(msgs)}")
    if not msgs:
        raise BadRecord("bad_messages", "field 'messages' is empty")
    check_message_items(msgs, "messages")
    if msgs[-1]["role"] != "assistant":
        raise BadRecord(
            "bad_messages", f"the last message must be the assistant answer, got role {msgs[-1]['role']!r}"
        )
    return obj


def _lone_surrogate(value, where: str) -> tuple[str, int, str] | None:
    """(field, character index, the character) of the first unpaired surrogate in the strings of `value`."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return where, e.start, value[e.start]
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        sub = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        found = _lone_surrogate(child, sub)
        if found:
            return found
    return None


def _parse_line(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(
            "non_utf8", f"bytes are not valid UTF-8 at byte {e.start} ({raw[e.start : e.start + 4]!r})"
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord("invalid_json", f"malformed JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise BadRecord("not_an_object", f"each line must be a JSON object, got {_type_name(obj)}")
    found = _lone_surrogate(obj, "") if _SURROGATE_ESCAPE.search(raw) else None
    if found:
        name, pos, char = found
        raise BadRecord(
            "invalid_unicode",
            f"field '{name}' holds a lone surrogate \\u{ord(char):04x} at character {pos} "
            "(an unpaired UTF-16 escape: valid JSON, not text); fix the escape or remove the character",
        )
    return obj


def check_sft(obj: dict, fmt: str) -> tuple[dict, str]:
    """An SFT record checked against the file's format (``auto`` takes the record's own): (record, its format)."""
    this = record_format(obj)
    if this is None:
        raise BadRecord("missing_field", "record has neither 'messages' (chat) nor 'instruction'/'output' (alpaca)")
    if fmt != "auto" and this != fmt:
        raise BadRecord("format_mismatch", f"record is {this} but the file's format is {fmt}")
    return (check_chat(obj) if this == "chat" else check_alpaca(obj)), this


def _check_sft_answer(obj: dict, this: str) -> None:
    if not answer_text(obj):
        field_name = "the last message's content" if this == "chat" else "field 'output'"
        raise BadRecord(
            "empty_answer",
            f"{field_name} is empty after cleaning (only whitespace, zero-width or "
            "control characters): the sample would teach nothing but EOS",
        )


@dataclass(frozen=True)
class RecordSchema:
    """How one kind of JSONL record is checked and cleaned; `read_records` does the rest (lines, errors, counts).

    Attributes:
        check: ``(object, file format) -> (record, this record's format)``; raises `BadRecord`.
        clean: ``(record, stats) -> cleaned record`` (`clean_record` for SFT records).
        after_clean: checks that need the cleaned text (an empty answer); raises `BadRecord`.
        what: the records the file should hold, for the message on a missing file.
    """

    check: Callable[[dict, str], tuple[dict, str]]
    clean: Callable[[dict, CleaningStats], dict]
    after_clean: Callable[[dict, str], None]
    what: str


SFT_RECORDS = RecordSchema(check_sft, clean_record, _check_sft_answer, "alpaca or chat/messages records")


def read_records(
    path: str | Path,
    *,
    config_field: str = "data.train_file",
    format: str = "auto",
    on_bad_record: str = "error",
    clean: bool = True,
    skip_hint: str = "set data.on_bad_record: skip to skip and count bad lines",
    schema: RecordSchema = SFT_RECORDS,
) -> ReadResult:
    """Read, check and clean one JSONL file.

    Args:
        path: the JSONL file, used as given (relative paths are relative to the working directory), or
            ``embedded:<name>`` for a dataset packaged with hf_stable (``embedded:train``, ``embedded:eval``).
        config_field: the config key the path came from, named in errors.
        format: ``"auto"`` (the first good record decides), ``"alpaca"`` or ``"chat"``.
        on_bad_record: ``"error"`` stops at the first bad line; ``"skip"`` skips and counts it.
        clean: remove zero-width/control characters and NFC-normalise (see ``cleaning.py``).
        skip_hint: how the caller's user skips bad lines, in the error (the audit CLI's flag is ``--skip-bad``).
        schema: what a record is: SFT records (the default) or preference pairs (``pairs.PAIR_RECORDS``).

    Raises:
        DataError: missing file, empty file, no good record left, or (with ``"error"``) a bad line,
            with ``file:line: what is wrong`` and how to fix or skip it.
    """
    path_s = str(path)
    p = data_file(path)
    if p is None:
        raise DataError(
            f"{config_field}: {path_s} is not a packaged dataset; they are: {', '.join(embedded_data_paths())}"
        )
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise DataError(
            f"{config_field}: {path_s} {what} (working directory {Path.cwd()}); "
            f"set {config_field} to a JSONL file ({schema.what})"
        )
    raw = p.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    result = ReadResult(records=[], format=format)
    fmt = format
    lines = raw.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the newline ending the last line does not start a blank line
    for lineno, line in enumerate(lines, start=1):
        line = line.rstrip(b"\r")
        if not line.strip():
            result.n_blank += 1
            continue
        result.n_lines += 1
        try:
            obj, this = schema.check(_parse_line(line), fmt)
            if clean:
                obj = schema.clean(obj, result.cleaning)
            schema.after_clean(obj, this)
        except BadRecord as bad:
            msg = f"{path_s}:{lineno}: {bad}"
            if on_bad_record != "skip":
                raise DataError(f"{msg}\n  fix the line, or {skip_hint}") from None
            result.skipped[bad.reason] += 1
            if len(result.skipped_examples) < _MAX_EXAMPLES:
                result.skipped_examples.append(msg)
            continue
        if fmt == "auto":
            fmt = this
        result.records.append(Record(obj, path_s, lineno))
    result.format = fmt
    if result.n_lines == 0:
        raise DataError(f"{path_s}:1: empty file (no records); {config_field} must name a non-empty JSONL file")
    if not result.records:
        raise DataError(
            f"{path_s}: all {result.n_lines} lines are bad ({dict(result.skipped)}); first: "
            f"{result.skipped_examples[0] if result.skipped_examples else '?'}"
        )
    return result
