"""Checkpoints that are safe to resume from: a completion marker, and the choice of where to resume.

The Trainer writes a checkpoint as many files over several seconds (adapter, optimizer, scheduler, RNG
state per rank, `trainer_state.json`), and under DDP/DeepSpeed every rank writes its own part with no
barrier at the end. A job killed in that window leaves a `checkpoint-N` folder that *looks* like the
newest checkpoint — `transformers.trainer_utils.get_last_checkpoint` picks it — and resuming from it
fails or, worse, silently loads a half-written optimizer state.

So a checkpoint counts as complete only when `CheckpointMarker` (`callbacks/checkpoint_marker.py`) has written `hf_stable_complete.json`
into it. The marker is written by the main process *after* every rank has returned from the save (an
all-reduce barrier in `on_save`), atomically (temp file + rename), and it lists every file with its
size, so a checkpoint later truncated or partly deleted is rejected too.

Resuming also retires the future: when a run starts at step k (fresh: k = 0), the markers of checkpoints
with a step above k are renamed to `hf_stable_superseded.json`. Without that, a later `resume: auto`
could jump to a checkpoint left by an older, abandoned trajectory in the same directory. Nothing is
deleted; renaming the file back restores a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

from hf_stable.distributed import broadcast_object
from hf_stable.errors import ConfigError
from hf_stable.logging import get_logger, is_main_process

logger = get_logger(__name__)

MARKER_FILE = "hf_stable_complete.json"
SUPERSEDED_FILE = "hf_stable_superseded.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(path: str | Path) -> int | None:
    """The N of a `checkpoint-N` folder name, else None."""
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Every `checkpoint-N` folder in `output_dir`, oldest step first (complete or not)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def _file_sizes(folder: Path) -> dict[str, int]:
    skip = {MARKER_FILE, SUPERSEDED_FILE}
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in skip and not p.name.startswith(".")
    }


def mark_complete(checkpoint_dir: str | Path, step: int, n_ranks: int = 1) -> Path:
    """Write the completion marker of `checkpoint_dir` (call once every rank has finished saving).

    Returns:
        The marker's path.
    """
    folder = Path(checkpoint_dir)
    marker = {
        "step": int(step),
        "world_size": int(n_ranks),
        "time": round(time.time(), 3),
        "files": _file_sizes(folder),
    }
    tmp = folder / f".{MARKER_FILE}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(marker, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(folder / MARKER_FILE)
    except BaseException:  # a full disk: no half-written marker left behind, the checkpoint stays incomplete
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return folder / MARKER_FILE


def checkpoint_problems(checkpoint_dir: str | Path) -> list[str]:
    """Why `checkpoint_dir` cannot be resumed from (an empty list means it is complete)."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        return [f"{folder} does not exist"]
    marker_path = folder / MARKER_FILE
    if not marker_path.is_file():
        if (folder / SUPERSEDED_FILE).is_file():
            return [f"{folder.name} was superseded by a later restart from an earlier step ({SUPERSEDED_FILE})"]
        reason = f"{folder.name} has no {MARKER_FILE}: its save was interrupted, or it was written without "
        return [reason + "hf_stable's CheckpointMarker callback"]
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
        files = dict(marker["files"])
        marked_step = int(marker["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{marker_path} is unreadable ({type(e).__name__}: {e})"]
    problems = []
    step = checkpoint_step(folder)
    if step is not None and marked_step != step:
        problems.append(f"{MARKER_FILE} says step {marked_step} but the folder is {folder.name}")
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is listed in {MARKER_FILE} but missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, {size} when the checkpoint was completed")
    if "trainer_state.json" not in files:
        problems.append("trainer_state.json was not part of the save")
    return problems


def is_complete(checkpoint_dir: str | Path) -> bool:
    return not checkpoint_problems(checkpoint_dir)


def latest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest `checkpoint-N` in `output_dir` that is complete; None when there is none.

    Newer checkpoints that are incomplete are skipped with a warning naming the reason.
    """
    for folder in reversed(list_checkpoints(output_dir)):
        problems = checkpoint_problems(folder)
        if not problems:
            return folder
        logger.warning("not resuming from %s: %s", folder, "; ".join(problems))
    return None


def supersede_after(output_dir: str | Path, step: int) -> list[Path]:
    """Rename the markers of complete checkpoints newer than `step` (main process only). Returns them."""
    retired = []
    for folder in list_checkpoints(output_dir):
        marker = folder / MARKER_FILE
        if checkpoint_step(folder) > step and marker.is_file():
            marker.replace(folder / SUPERSEDED_FILE)
            retired.append(folder)
    if retired:
        logger.warning(
            "this run restarts at step %d, so %d newer checkpoint(s) from an earlier run were marked superseded: %s",
            step,
            len(retired),
            ", ".join(p.name for p in retired),
        )
    return retired


def _saved_step(checkpoint_dir: str) -> int:
    """The global step a checkpoint holds (its trainer_state.json, else its folder name)."""
    try:
        return int(json.loads((Path(checkpoint_dir) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return checkpoint_step(checkpoint_dir) or 0


def _explicit_checkpoint(value: str, output_dir: str, field_name: str) -> Path:
    path = Path(value).expanduser()
    if not path.exists() and (Path(output_dir) / value).exists():
        path = Path(output_dir) / value
    problems = checkpoint_problems(path)
    if problems:
        newest = latest_complete_checkpoint(path.parent) if path.parent.is_dir() else None
        hint = f"use {newest} or 'auto'" if newest else "use 'auto' or 'never'"
        raise ConfigError(f"{field_name}: cannot resume from {value!r}: {'; '.join(problems)} ({hint})")
    return path


def resolve_resume(resume: str, args) -> str | None:
    """The checkpoint `trainer.train(resume_from_checkpoint=...)` should get, the same on every rank.

    Args:
        resume: `runtime.resume` — 'auto', 'never' or a checkpoint path.
        args: the run's `TrainingArguments` (its `output_dir`, and `resume_from_checkpoint`, which is honoured
            as an explicit path when set).

    Raises:
        ConfigError: an explicit checkpoint is missing or incomplete, or `runtime.resume` and
            `training.resume_from_checkpoint` name different checkpoints.

    Example:
        >>> trainer.train(resume_from_checkpoint=resolve_resume(cfg.runtime.resume, args))
    """
    explicit = args.resume_from_checkpoint
    if explicit and resume not in ("auto", "never") and Path(explicit) != Path(resume):
        raise ConfigError(
            f"runtime.resume: got {resume!r} but training.resume_from_checkpoint is {explicit!r}; set only one"
        )
    decision: tuple[str | None, str | None] = (None, None)
    if is_main_process():
        try:
            if explicit or resume not in ("auto", "never"):
                field_name = "training.resume_from_checkpoint" if explicit else "runtime.resume"
                chosen = str(_explicit_checkpoint(explicit or resume, args.output_dir, field_name))
            elif resume == "auto":
                found = latest_complete_checkpoint(args.output_dir)
                chosen = str(found) if found else None
            else:
                chosen = None
            supersede_after(args.output_dir, _saved_step(chosen) if chosen else 0)
            decision = (chosen, None)
        except ConfigError as e:
            decision = (None, "\n".join(e.problems))
    # Node-local disks could show the ranks different folders: rank 0 decides for everyone.
    chosen, error = broadcast_object(decision)
    if error:
        raise ConfigError(error.split("\n"))
    if chosen:
        logger.info(
            "resuming from %s (runtime.resume: %s; --runtime.resume never starts fresh)", chosen, explicit or resume
        )
    return chosen
