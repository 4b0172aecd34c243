"""Run inside a private mount namespace with a small tmpfs mounted (see tests/test_full_disk.py): real full-disk
failures through the recipe's error boundary, no fault injection.

    unshare -m sh -c 'mount -t tmpfs -o size=256k tmpfs DISK && python small_disk.py DISK REPORT.json'

Cases, in this order, each recorded in REPORT.json (outside the tmpfs, which vanishes with the namespace):
    save    `torch.save` of 1.2 MB into a 256 KiB disk (torch's zip writer: RuntimeError, no errno)
    bug     a ValueError raised outside any save, on the same (now full) disk
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import torch

from hf_stable.outputs import INCOMPLETE_FILE, OutputDir, error_boundary


def run_case(out: OutputDir, body) -> dict:
    stderr = io.StringIO()
    outcome: dict = {}
    with contextlib.redirect_stderr(stderr):
        try:
            with error_boundary(out):
                body()
            outcome["exit"] = 0
        except SystemExit as e:
            outcome["exit"] = e.code
        except Exception as e:  # noqa: BLE001 - a bug is re-raised by the boundary: note its type
            outcome["exit"] = "raised"
            outcome["raised"] = f"{type(e).__name__}: {e}"
    outcome["stderr"] = stderr.getvalue()
    outcome["status"] = json.loads((out.path / INCOMPLETE_FILE).read_text())
    return outcome


def main(disk: Path, report: Path) -> None:
    out = OutputDir(disk / "run").start({"case": "small disk"})
    results = {}

    def write_big():  # the only "save" on the way is torch's own
        torch.save(torch.zeros(300_000), out.path / "big.pt")

    results["save"] = run_case(out, write_big)

    def bug():
        raise ValueError("a bug, not the disk")

    results["bug"] = run_case(out, bug)
    report.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
