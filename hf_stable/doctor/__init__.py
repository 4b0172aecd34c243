"""Preflight doctor: environment, config hazards and a dry run, before a single training step is spent."""

from hf_stable.doctor.checkup import DoctorBlockingError, blocking_on_any_rank, preflight, run_doctor
from hf_stable.doctor.command import main
from hf_stable.doctor.findings import SEVERITIES, DoctorReport, Finding
from hf_stable.doctor.report import REPORT_JSON, REPORT_MD, render_markdown, render_text, save_report

__all__ = [
    "REPORT_JSON",
    "REPORT_MD",
    "SEVERITIES",
    "DoctorBlockingError",
    "DoctorReport",
    "Finding",
    "blocking_on_any_rank",
    "main",
    "preflight",
    "render_markdown",
    "render_text",
    "run_doctor",
    "save_report",
]
