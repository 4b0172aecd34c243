"""A finished run's output directory is never trained over without a word.

A run is finished when `run_summary.json` exists (`hf_stable.outputs`). Starting another run into that directory
used to retrain and overwrite the adapter and the summary, rename the stability events and the quarantine, and
leave files only the old run wrote (`report/bad_step_samples.png`) beside the new report: a model card could then
show plots of a run it does not describe. So a new run into a finished run's directory:

* stops with one line naming the directory and the two ways on: a new `training.output_dir`, or
  `runtime.overwrite: true`; nothing in the directory is touched;
* with `runtime.overwrite: true`, moves every entry of the old run (checkpoints included: a resume must not
  continue the old trajectory) into `replaced-<time>/` inside the directory, says each one once, and starts fresh.
  Nothing is deleted.
"""

from __future__ import annotations

import time
from pathlib import Path

SUMMARY_FILE = "run_summary.json"
REPLACED_PREFIX = "replaced-"


def finished_at(path: Path) -> float | None:
    """When the run in `path` finished (its summary's modification time), or None when it holds no finished run."""
    summary = path / SUMMARY_FILE
    try:
        return summary.stat().st_mtime if summary.is_file() else None
    except OSError:
        return None


def _stamp(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(when))


def refusal(path: Path, when: float) -> str:
    """The one line a new run into a finished run's directory stops with (without `runtime.overwrite`)."""
    return (
        f"training.output_dir: {path} holds a finished run (run_summary.json of {_stamp(when)}); nothing was changed. "
        f"Keep it and train into a new directory (--training.output_dir {path}-2), or replace it with "
        f"--runtime.overwrite true (its files are moved to {path}/{REPLACED_PREFIX}<time>/, nothing is deleted)"
    )


def holds_cwd(path: Path) -> str | None:
    """Why `runtime.overwrite` must not empty `path`: it is (or contains) the current directory, where the user's
    own files live beside the run's (`training.output_dir: .`). None when moving its entries aside is safe."""
    here, there = Path.cwd().resolve(), path.resolve()
    if here == there or there in here.parents:
        return (
            f"training.output_dir: {path} holds a finished run and is the current directory (or contains it); "
            f"--runtime.overwrite true would move every file in it aside, yours included. Train into a new "
            f"directory (--training.output_dir {path / 'run-2'})"
        )
    return None


def move_aside(path: Path, when: float) -> tuple[Path, list[str]]:
    """Move every entry of the finished run in `path` into a new `replaced-<time>/` folder inside it (earlier
    `replaced-*` folders stay where they are). Returns the folder and the names moved, sorted.

    Raises:
        OSError: a rename failed (the caller reports it as an output-dir problem).
    """
    base = f"{REPLACED_PREFIX}{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}"
    target, n = path / base, 1
    while target.exists():
        n += 1
        target = path / f"{base}-{n}"
    names = sorted(p.name for p in path.iterdir() if not p.name.startswith(REPLACED_PREFIX))
    target.mkdir()
    for name in names:
        (path / name).replace(target / name)
    return target, names


def replaced_line(path: Path, when: float, target: Path, names: list[str]) -> str:
    """What `move_aside` did, in one line that names every entry moved."""
    return (
        f"runtime.overwrite: {path} held a finished run ({_stamp(when)}); moved its {len(names)} entries to "
        f"{target}: {', '.join(names)}"
    )
