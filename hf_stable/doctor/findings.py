"""What the doctor found: one `Finding` per check outcome, collected in a `DoctorReport`.

A finding is a verdict a user can act on: what was checked, the evidence (numbers, names), and how to fix it.
Only "error" findings block training; warnings are things that often go wrong but may be intended.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("ok", "info", "warning", "error")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass
class Finding:
    """One check's outcome.

    Args:
        severity: "ok" (checked, fine), "info" (a fact worth knowing), "warning" (likely a problem, training may
            still run) or "error" (blocking: training would fail or silently learn nothing).
        what: one line naming the problem or the fact.
        evidence: the numbers / names that support it.
        fix: how to fix it (empty for ok/info findings that need nothing).
        check: stable id of the check (``section.name``), for tests and for filtering.
        section: "environment", "hazards" or "dry_run".

    Raises:
        ValueError: an unknown severity (a bug in a check, not user input).

    Example:
        >>> Finding("warning", "fp16 on a Qwen2 model", "model_type=qwen2", "use bf16", check="hazards.fp16_family")
    """

    severity: str
    what: str
    evidence: str = ""
    fix: str = ""
    check: str = ""
    section: str = ""

    def __post_init__(self):
        if self.severity not in _RANK:
            raise ValueError(f"severity: got {self.severity!r}, allowed: {', '.join(SEVERITIES)}")
        if not self.section and "." in self.check:
            self.section = self.check.split(".", 1)[0]

    @property
    def blocking(self) -> bool:
        return self.severity == "error"


@dataclass
class DoctorReport:
    """Every finding of one doctor run, plus the facts and measurements behind them.

    Args:
        findings: in the order the checks ran (environment, hazards, dry run).
        facts: JSON-safe details per section (versions, GPUs, grad-norm tables, memory, timings).
        seconds: wall time of the whole run.
        config_source: the YAML file checked, when there is one.

    Example:
        >>> report = run_doctor(cfg)
        >>> report.exit_code, [f.what for f in report.blocking_findings()]
    """

    findings: list[Finding] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    config_source: str | None = None
    created: float = field(default_factory=time.time)

    def add(self, findings: list[Finding] | Finding) -> None:
        self.findings.extend([findings] if isinstance(findings, Finding) else findings)

    def by_check(self, check: str) -> list[Finding]:
        """Findings of one check id (or of every check under a prefix ending with '.')."""
        if check.endswith("."):
            return [f for f in self.findings if f.check.startswith(check)]
        return [f for f in self.findings if f.check == check]

    def blocking_findings(self) -> list[Finding]:
        return [f for f in self.findings if f.blocking]

    @property
    def blocking(self) -> bool:
        return any(f.blocking for f in self.findings)

    @property
    def worst(self) -> str:
        return max((f.severity for f in self.findings), key=_RANK.__getitem__, default="ok")

    @property
    def exit_code(self) -> int:
        """0 when nothing blocks, 1 when a blocking problem was found (the CLI's exit status)."""
        return 1 if self.blocking else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}

    def to_dict(self) -> dict:
        return {
            "config": self.config_source,
            "verdict": "blocking problems found" if self.blocking else "no blocking problem",
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "seconds": round(self.seconds, 2),
            "created": self.created,
            "findings": [asdict(f) for f in self.findings],
            "facts": _json_safe(self.facts),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Strict JSON (NaN/Inf become null) so any parser, not only Python's, reads it."""
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False, allow_nan=False)


def _json_safe(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "tolist"):
        return _json_safe(value.tolist())
    return str(value)
