"""`hf-stable doctor --config CONFIG.yaml [--section.key value ...] [--json] [--no-dry-run] [--output DIR]`."""

from __future__ import annotations

import contextlib
import sys

from hf_stable.doctor.checkup import run_doctor
from hf_stable.doctor.report import render_text, save_report

USAGE = """usage: hf-stable doctor [--config CONFIG.yaml] [--section.key VALUE ...] [--json] [--no-dry-run]
                        [--output DIR]

Preflight checks before training: environment, config hazards, and a few-step dry run on the configured model
and data (weights restored afterwards). Exit code 0 when nothing blocks, 1 when a blocking problem was found,
2 when the config itself cannot be read.

  --json         print the report as JSON (stdout) instead of the table
  --no-dry-run   environment and config hazards only (no model run)
  --output DIR   also write DIR/doctor_report.json and DIR/doctor_report.md"""


def main(argv: list[str] | None = None) -> int:
    from hf_stable.config import load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    as_json = "--json" in argv
    dry = "--no-dry-run" not in argv
    output = None
    rest = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--json", "--no-dry-run"):
            pass
        elif arg == "--output" and i + 1 < len(argv):
            output, i = argv[i + 1], i + 1
        elif arg.startswith("--output="):
            output = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    cfg = load_config(argv=rest, check=False)  # what only the config shows is reported as findings below
    # Libraries print to stdout while loading (DeepSpeed's accelerator probe, say); keep stdout for the report
    # alone so `--json` output pipes straight into a parser.
    with contextlib.redirect_stdout(sys.stderr):
        report = run_doctor(cfg, dry_run=dry)
    if output:
        save_report(report, output)
    print(report.to_json() if as_json else render_text(report), flush=True)
    return report.exit_code
