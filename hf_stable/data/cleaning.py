"""Text cleaning: invisible and control characters out, Unicode in NFC.

Why: zero-width characters and stray control bytes (copy-paste from web pages, BOMs from Windows
editors, terminal escapes) are invisible to a reviewer but become real tokens. The model then learns
to emit them, and exact-match evaluation fails on answers that look identical. NFC makes the same
visible text always tokenize the same way (a precomposed "é" and "e" + combining accent are
different byte sequences).

What is removed: U+200B–U+200D (zero-width space / non-joiner / joiner), U+2060 (word joiner),
U+FEFF (BOM / zero-width no-break space), every C0 control (U+0000–U+001F) except ``\\n`` and
``\\t`` (so ``\\r`` goes and Windows line ends become ``\\n``), DEL (U+007F) and every C1 control
(U+0080–U+009F). Everything else is kept.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff"
_CONTROLS = (
    "".join(chr(c) for c in range(0x20) if chr(c) not in "\n\t") + "\x7f" + "".join(chr(c) for c in range(0x80, 0xA0))
)
_ZERO_WIDTH_RE = re.compile(f"[{re.escape(ZERO_WIDTH)}]")
_CONTROL_RE = re.compile(f"[{re.escape(_CONTROLS)}]")


def clean_text(text: str) -> tuple[str, int, int, bool]:
    """Clean one string.

    Returns:
        (cleaned text, zero-width characters removed, control characters removed, whether NFC changed it).
    """
    out, n_zw = _ZERO_WIDTH_RE.subn("", text)
    out, n_ctrl = _CONTROL_RE.subn("", out)
    nfc = unicodedata.normalize("NFC", out)
    return nfc, n_zw, n_ctrl, nfc != out


@dataclass
class CleaningStats:
    """What cleaning did to a file: per-field character counts and how many records changed.

    Field names are ``instruction`` / ``input`` / ``output`` for alpaca records and ``messages.<role>``
    for chat records.
    """

    records_changed: int = 0
    zero_width_removed: Counter = field(default_factory=Counter)
    control_removed: Counter = field(default_factory=Counter)
    nfc_changed: Counter = field(default_factory=Counter)

    @property
    def chars_removed(self) -> int:
        return sum(self.zero_width_removed.values()) + sum(self.control_removed.values())

    def to_dict(self) -> dict:
        fields = sorted(set(self.zero_width_removed) | set(self.control_removed) | set(self.nfc_changed))
        return {
            "records_changed": self.records_changed,
            "chars_removed": self.chars_removed,
            "per_field": {
                f: {
                    "zero_width_removed": self.zero_width_removed[f],
                    "control_removed": self.control_removed[f],
                    "nfc_changed": self.nfc_changed[f],
                }
                for f in fields
            },
        }


def clean_record(record: dict, stats: CleaningStats) -> dict:
    """Return a cleaned copy of an alpaca or chat record (already schema-checked) and update `stats`.

    Only the text fields are touched; extra keys (``family``, ``lang``, ...) are kept as they are.
    """
    changed = False

    def _clean(value: str, name: str) -> str:
        nonlocal changed
        out, n_zw, n_ctrl, nfc = clean_text(value)
        if n_zw:
            stats.zero_width_removed[name] += n_zw
        if n_ctrl:
            stats.control_removed[name] += n_ctrl
        if nfc:
            stats.nfc_changed[name] += 1
        changed = changed or out != value
        return out

    out = dict(record)
    if "messages" in record:
        out["messages"] = [{**m, "content": _clean(m["content"], f"messages.{m['role']}")} for m in record["messages"]]
    else:
        for name in ("instruction", "input", "output"):
            if isinstance(record.get(name), str):
                out[name] = _clean(record[name], name)
    if changed:
        stats.records_changed += 1
    return out
