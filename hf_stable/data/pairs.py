"""Preference pairs (DPO data): a prompt, a chosen and a rejected answer, read and rendered as SFT records are.

Accepted records (one JSON object a line, TRL's preference field names):
    text: ``{"prompt": str, "chosen": str, "rejected": str, ...extra keys}``; the prompt is one user turn.
    chat: ``{"prompt": [messages...], "chosen": [messages...], "rejected": [messages...]}``: the prompt is the
          conversation before the answer (its last message is not the assistant's), each answer is a list ending
          with the assistant message (usually just that one message).

Why the SFT rules: a DPO stage trains on top of an SFT adapter, so a pair must reach the model exactly as an SFT
record with the same question did: the same chat template rendering, the same end-of-turn token, the same cleaning
(``cleaning.py``). Each side of a pair is turned into an SFT record (`pair_side`) and goes through
``prompts.py`` / ``samples.py``; nothing here renders text its own way. Bad lines are ``file:line`` errors or, with
``on_bad_record: skip``, skipped and counted by reason, as ``records.py`` does for SFT files; pair-only reasons:
``same_answers`` (chosen equals rejected after cleaning: no preference to learn) and ``empty_answer``.

The audit (`audit_pairs`, and ``hf-stable audit PAIRS.jsonl`` which recognises the fields) is the SFT audit of the
chosen side plus what only pairs have: the rejected side's lengths, truncation and stop-token coverage, and pairs
whose two answers become the same tokens once cut to ``max_length`` (dropped: ``same_after_truncation``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from hf_stable.data.cleaning import CleaningStats, clean_text
from hf_stable.data.prompts import answer_text, render_all, resolve_template
from hf_stable.data.records import BadRecord, Record, RecordSchema, check_message_items, read_records
from hf_stable.data.samples import encode_records
from hf_stable.resources import data_file

PAIR_FIELDS = ("prompt", "chosen", "rejected")
SIDES = ("chosen", "rejected")


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _check_messages(value, name: str, *, last_assistant: bool) -> None:
    if not isinstance(value, list) or not value:
        raise BadRecord("bad_messages", f"field '{name}' must be a non-empty list of messages")
    check_message_items(value, name)
    last = value[-1]["role"]
    if last_assistant and last != "assistant":
        raise BadRecord("bad_messages", f"the last message of '{name}' must be the assistant answer, got {last!r}")
    if not last_assistant and last == "assistant":
        raise BadRecord("bad_messages", f"field '{name}' ends with an assistant message: it is the question only")


def check_pair(obj: dict, fmt: str) -> tuple[dict, str]:
    """A preference record checked against the file's format: (record, ``"text"`` or ``"chat"``).

    Raises:
        BadRecord: a missing field, a wrong type, text and messages mixed, or a format other than the file's.
    """
    for name in PAIR_FIELDS:
        if name not in obj:
            raise BadRecord(
                "missing_field", f"missing field '{name}' (preference pairs need prompt, chosen, rejected)"
            )
    this = "chat" if isinstance(obj["prompt"], list) else "text"
    for name in PAIR_FIELDS:
        value = obj[name]
        if this == "text" and not isinstance(value, str):
            raise BadRecord(
                "wrong_type", f"field '{name}' must be a string like 'prompt' (text pairs), got {_type_name(value)}"
            )
        if this == "chat":
            if not isinstance(value, list):
                raise BadRecord(
                    "wrong_type",
                    f"field '{name}' must be a list of messages like 'prompt' (chat pairs), got {_type_name(value)}",
                )
            _check_messages(value, name, last_assistant=name != "prompt")
    if fmt not in ("auto", this):
        raise BadRecord("format_mismatch", f"record is a {this} pair but the file's pairs are {fmt}")
    return obj, this


def clean_pair(record: dict, stats: CleaningStats) -> dict:
    """A cleaned copy of a pair (`cleaning.py` rules); counts go to `stats` under ``prompt`` / ``chosen`` /
    ``rejected`` (chat pairs: ``<field>.<role>``)."""
    changed = False

    def _clean(value: str, name: str) -> str:
        nonlocal changed
        out, n_zw, n_ctrl, nfc = clean_text(value)
        stats.zero_width_removed[name] += n_zw
        stats.control_removed[name] += n_ctrl
        stats.nfc_changed[name] += int(nfc)
        changed = changed or out != value
        return out

    out = dict(record)
    for name in PAIR_FIELDS:
        value = record[name]
        if isinstance(value, str):
            out[name] = _clean(value, name)
        else:
            out[name] = [{**m, "content": _clean(m["content"], f"{name}.{m['role']}")} for m in value]
    for counter in (stats.zero_width_removed, stats.control_removed, stats.nfc_changed):
        for key in [k for k, v in counter.items() if not v]:
            del counter[key]
    stats.records_changed += changed
    return out


def pair_side(record: dict, side: str) -> dict:
    """The SFT record of one side of a pair: the prompt and the `side` answer (``"chosen"`` or ``"rejected"``).

    A text pair becomes an alpaca record (the prompt is the instruction: one user turn, as for SFT data), a chat
    pair a messages record. Extra keys (``family``, ``lang``) are kept.
    """
    extra = {k: v for k, v in record.items() if k not in PAIR_FIELDS}
    if isinstance(record["prompt"], str):
        return {**extra, "instruction": record["prompt"], "input": "", "output": record[side]}
    return {**extra, "messages": [*record["prompt"], *record[side]]}


def _check_answers(obj: dict, this: str) -> None:
    answers = {side: answer_text(pair_side(obj, side)) for side in SIDES}
    for side, text in answers.items():
        if not text:
            raise BadRecord(
                "empty_answer",
                f"field '{side}' has an empty answer after cleaning (only whitespace, zero-width or control "
                "characters)",
            )
    if answers["chosen"] == answers["rejected"]:
        raise BadRecord("same_answers", "'chosen' and 'rejected' are the same answer: the pair prefers nothing")


PAIR_RECORDS = RecordSchema(check_pair, clean_pair, _check_answers, "preference pairs: prompt, chosen, rejected")


def read_pairs(path: str | Path, *, config_field: str = "dpo.train_file", on_bad_record: str = "error", **kw):
    """`read_records` for preference pairs (same arguments; `format` is ``auto``, ``text`` or ``chat``).

    Raises:
        DataError: as `read_records`, with ``file:line: what is wrong``.
    """
    return read_records(path, config_field=config_field, on_bad_record=on_bad_record, schema=PAIR_RECORDS, **kw)


def is_pairs_file(path: str | Path) -> bool:
    """Whether the first JSON line of `path` has the preference fields (for ``hf-stable audit``)."""
    p = data_file(path)
    if p is None or not p.is_file():
        return False
    with open(p, "rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    obj = json.loads(raw.decode("utf-8-sig"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    return False
                return isinstance(obj, dict) and "chosen" in obj and "rejected" in obj
    return False


def side_records(records: list[Record], side: str) -> list[Record]:
    """`records` (pairs) as SFT records of one side, each keeping its file:line."""
    return [replace(r, data=pair_side(r.data, side)) for r in records]


def render_pairs(tokenizer, records: list[Record], template: str = "auto") -> list[dict]:
    """Each pair as text: ``{"prompt", "chosen", "rejected"}`` where the prompt is the SFT prompt (the chat template's
    generation prompt, or the alpaca layout after BOS) and each answer is its supervised span through the end token,
    exactly as `samples.py` would train it. Extra keys are kept. For a trainer that tokenizes plain text
    (TRL's ``DPOTrainer`` with non-conversational data) and must not apply a template of its own.

    Raises:
        DataError: a conversation the template cannot render (naming file:line).
    """
    resolved = resolve_template(tokenizer, template)
    where = [r.where for r in records]
    sides = {s: render_all(tokenizer, [r.data for r in side_records(records, s)], resolved, where) for s in SIDES}
    bos = tokenizer.bos_token if resolved == "alpaca" and tokenizer.bos_token_id is not None else ""
    eos = tokenizer.eos_token if resolved == "alpaca" else ""
    out = []
    for rec, chosen, rejected in zip(records, sides["chosen"], sides["rejected"], strict=True):
        extra = {k: v for k, v in rec.data.items() if k not in PAIR_FIELDS}
        out.append(
            {**extra, "prompt": bos + chosen.prompt, "chosen": chosen.answer + eos, "rejected": rejected.answer + eos}
        )
    return out


def encode_pairs(tokenizer, records: list[Record], *, max_length: int, template: str = "auto", vocab_size=None):
    """Both sides of each pair encoded under the SFT rules: ``(kept pairs, {side: (samples, EncodeStats)}, dropped)``.

    A pair is kept when both sides keep a supervised token and their (possibly truncated) token ids differ; dropped
    pairs are counted by reason (``no_supervised_token``, ``same_after_truncation``) with their file:line.
    """
    resolved = resolve_template(tokenizer, template)
    encoded = {
        s: encode_records(
            tokenizer, side_records(records, s), max_length=max_length, template=resolved, vocab_size=vocab_size
        )
        for s in SIDES
    }
    by_id = {s: {x["record_id"]: x for x in encoded[s][0]} for s in SIDES}
    kept, dropped = [], {}
    for i, rec in enumerate(records):
        chosen, rejected = by_id["chosen"].get(i), by_id["rejected"].get(i)
        if chosen is None or rejected is None:
            reason = "no_supervised_token"
        elif chosen["input_ids"] == rejected["input_ids"]:
            reason = "same_after_truncation"
        else:
            kept.append(i)
            continue
        dropped.setdefault(reason, []).append(rec.where)
    return kept, encoded, dropped
