"""Rendering a `DoctorReport`: a terminal table, a markdown section for the model card, files in the output dir."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from hf_stable.doctor.findings import DoctorReport

REPORT_JSON = "doctor_report.json"
REPORT_MD = "doctor_report.md"
_SECTIONS = (("environment", "Environment"), ("hazards", "Config hazards"), ("dry_run", "Dry run"))
_MARK = {"ok": "ok", "info": "info", "warning": "WARN", "error": "ERROR"}


def _wrap_row(cells: list[str], widths: list[int]) -> list[str]:
    wrapped = [textwrap.wrap(c, w, break_on_hyphens=False) or [""] for c, w in zip(cells, widths, strict=False)]
    height = max(len(w) for w in wrapped)
    return [
        "  ".join(
            (w[i] if i < len(w) else "").ljust(width) for w, width in zip(wrapped, widths, strict=False)
        ).rstrip()
        for i in range(height)
    ]


def _verdict(report: DoctorReport) -> str:
    c = report.counts()
    tally = f"{c['error']} error(s), {c['warning']} warning(s), {c['info']} info, {c['ok']} ok"
    if report.blocking:
        return f"BLOCKING PROBLEMS FOUND ({tally}) in {report.seconds:.1f}s: fix the ERROR rows before training"
    if c["warning"]:
        return f"no blocking problem ({tally}) in {report.seconds:.1f}s; read the warnings"
    return f"clean bill of health ({tally}) in {report.seconds:.1f}s"


def render_text(report: DoctorReport, width: int | None = None) -> str:
    """A table of findings (severity, what, evidence, how to fix), one block per section, then the verdict."""
    width = width or max(shutil.get_terminal_size((140, 24)).columns, 100)
    free = width - 6 - 3 * 2
    widths = [6, int(free * 0.3), int(free * 0.42), free - int(free * 0.3) - int(free * 0.42)]
    lines = [f"hf-stable doctor: {report.config_source or '(config object)'}"]
    for key, title in _SECTIONS:
        rows = [f for f in report.findings if f.section == key]
        if not rows:
            continue
        lines += ["", f"== {title} " + "=" * max(width - len(title) - 4, 0)]
        lines += _wrap_row(["", "what", "evidence", "how to fix"], widths)
        for f in rows:
            lines += _wrap_row([_MARK[f.severity], f.what, f.evidence, f.fix], widths)
    lines += ["", _verdict(report)]
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: DoctorReport, heading: str = "### Preflight (hf-stable doctor)") -> str:
    """Markdown section for the model card: verdict plus the findings that are not plain "ok"."""
    lines = [heading, "", _verdict(report), ""]
    notable = [f for f in report.findings if f.severity != "ok"]
    if notable:
        lines += ["| severity | check | what | evidence | how to fix |", "|---|---|---|---|---|"]
        lines += [f"| {f.severity} | {f.check} | {_md(f.what)} | {_md(f.evidence)} | {_md(f.fix)} |" for f in notable]
    ok = [f.what for f in report.findings if f.severity == "ok"]
    if ok:
        lines += ["", "Passed: " + "; ".join(ok) + "."]
    return "\n".join(lines)


def save_report(report: DoctorReport, output_dir: str | Path) -> tuple[Path, Path]:
    """Write `doctor_report.json` and `doctor_report.md` into `output_dir` (created if needed)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_JSON).write_text(report.to_json() + "\n", encoding="utf-8")
    (out / REPORT_MD).write_text(
        render_markdown(report, heading="# Preflight (hf-stable doctor)") + "\n", encoding="utf-8"
    )
    return out / REPORT_JSON, out / REPORT_MD
