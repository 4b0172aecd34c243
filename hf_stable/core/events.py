"""Stability events: one JSON line per alert or action in `<output_dir>/stability_events.jsonl`.

Every rank computes the same events (decisions are all-reduced), but only the main process writes
and prints them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from hf_stable.logging import get_logger

logger = get_logger(__name__)

EVENTS_FILE = "stability_events.jsonl"
# monitor alerts whose usual cause is a too-high learning rate: the weights, not the data (the verdict's advice names
# the LR; the spike forensics then quarantine no record on gradient evidence alone)
LR_SIGNS = ("attn_logit_high", "attn_logit_growth", "grad_explosion", "loss_curvature")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan" / "inf": JSON has no literal for them
    if hasattr(value, "item") and callable(value.item):
        return _json_safe(value.item())
    return value


def write_event(
    output_dir: str | None,
    *,
    step: int,
    kind: str,
    message: str,
    source: str,
    group: str | None = None,
    value: Any = None,
    threshold: Any = None,
    severity: str = "warning",
    is_main: bool = True,
    **extra: Any,
) -> dict:
    """Append one event to the run's events file (main process only) and log it. Returns the event."""
    event = {
        "time": round(time.time(), 3),
        "step": int(step),
        "kind": kind,
        "severity": severity,
        "source": source,
        "group": group,
        "value": _json_safe(value),
        "threshold": _json_safe(threshold),
        "message": message,
    }
    event.update({k: _json_safe(v) for k, v in extra.items()})
    if is_main:
        log = logger.error if severity == "error" else logger.warning if severity == "warning" else logger.info
        log("step %d %s: %s", step, kind, message)
        if output_dir:
            path = Path(output_dir)
            path.mkdir(parents=True, exist_ok=True)
            with open(path / EVENTS_FILE, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(event, ensure_ascii=False) + "\n")
    return event


def read_events(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
