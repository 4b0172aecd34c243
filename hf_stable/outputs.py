"""The run's output directory: what marks a run finished, and the recipe's error boundary.

A run is finished only when `run_summary.json` exists. At start, stale finish markers from an earlier
run in the same directory are removed and `RUN_INCOMPLETE.json` is written; it is replaced by the
summary on success and records the error on failure, so a crashed run never looks finished.

The directory itself is user input: a path that cannot be created or written (a read-only parent, a file in
the way) is one `OutputDirError` naming the path and the OS error, decided on the main process and shared
with every rank. A full disk is an environment failure, not a bug: the error boundary reports it first, in
one line, with the checkpoint a rerun resumes from, and no traceback (`hf_stable.full_disk` decides what a full
disk is). Writes go through a temporary file that is removed when the write fails, and recording a failure never
raises (on a full disk it overwrites `RUN_INCOMPLETE.json` in place, which needs no new space).

A termination signal outside a training step (`hf_stable.errors.Preempted`) is recorded as "preempted". With
several ranks a message is printed once per job: rank 0 prints an error every rank has, each rank its own.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import yaml

from hf_stable.checkpoints import is_complete, list_checkpoints
from hf_stable.core.events import EVENTS_FILE
from hf_stable.errors import HfStableError, Preempted
from hf_stable.forensics.quarantine import QUARANTINE_FILE
from hf_stable.full_disk import describe_free, disk_full, errors_in_chain
from hf_stable.logging import get_logger, is_main_process, process_rank

logger = get_logger(__name__)

SUMMARY_FILE = "run_summary.json"
INCOMPLETE_FILE = "RUN_INCOMPLETE.json"
CONFIG_FILE = "resolved_config.yaml"
FINISH_MARKERS = (SUMMARY_FILE, "README.md")
# with several ranks, how long a rank other than 0 waits for the launcher to end it once rank 0 has reported the
# error every rank has (torch elastic stops the other ranks within a second of the first exit)
FOLLOWER_WAIT_SECONDS = 10.0
# how gloo and NCCL say that another rank left a collective (it failed or stopped): not this rank's own failure
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote process exited")


class OutputDirError(HfStableError):
    """The output directory cannot be created or written (the message names the path and the OS error)."""


def describe_os_error(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    where = f": {e.filename}" if e.filename else ""
    return f"[{name or e.errno}] {e.strerror or e}{where}"


class OutputDir:
    """Lifecycle of one run's output directory (writes happen on the main process only)."""

    def __init__(self, path: str | Path, overwrite: bool = False):
        self.path = Path(path)
        self.overwrite = overwrite  # `runtime.overwrite`: a finished run here is moved aside instead of refused
        self.started = time.time()
        self.finished = False

    def start(self, config: dict) -> OutputDir:
        """Create the directory, clear finish markers, write RUN_INCOMPLETE.json and the resolved config.

        Every rank must call it (the main process's verdict is shared with the others).

        Raises:
            OutputDirError: the directory cannot be created or written, on every rank.
        """
        from hf_stable.distributed import broadcast_object

        problem = None
        if is_main_process():
            try:
                problem = self._finished_run()
                if problem is None:
                    self._prepare(config)
            except OSError as e:
                problem = self._start_problem(e)
        problem = broadcast_object(problem)
        if problem:
            raise OutputDirError(problem)
        return self

    def _finished_run(self) -> str | None:
        """A finished run in the directory: refused (the message), or moved aside with `overwrite` (see
        `hf_stable.finished_run`)."""
        from hf_stable import finished_run

        when = finished_run.finished_at(self.path)
        if when is None:
            return None
        if not self.overwrite:
            return finished_run.refusal(self.path, when)
        unsafe = finished_run.holds_cwd(self.path)
        if unsafe:
            return unsafe
        target, names = finished_run.move_aside(self.path, when)
        print(finished_run.replaced_line(self.path, when, target, names), flush=True)
        return None

    def _prepare(self, config: dict) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(errno.EEXIST, "exists and is not a directory", str(self.path))
        self.path.mkdir(parents=True, exist_ok=True)
        for name in FINISH_MARKERS:
            (self.path / name).unlink(missing_ok=True)
        self._write_json(INCOMPLETE_FILE, {"status": "running", "started": self.started})
        self._write_text(CONFIG_FILE, yaml.safe_dump(config, sort_keys=False, allow_unicode=True))

    def _start_problem(self, e: OSError) -> str:
        if disk_full(e):
            fix = "free space on that disk or choose a directory on another one"
        elif e.errno in (errno.EEXIST, errno.ENOTDIR):
            fix = "a file is in the way: remove it or choose another directory"
        else:
            fix = "choose a directory you can write to (or fix its permissions)"
        return f"training.output_dir: cannot use {self.path}: {describe_os_error(e)}; {fix}"

    def set_aside_events(self, resuming: bool) -> Path | None:
        """A fresh run (not a resume) into a directory that holds an earlier run's `stability_events.jsonl` (and
        `quarantine.jsonl`): rename each to `<name>.<time>.jsonl` so the report and model card show this run's
        events and quarantine only, and nothing is lost. Returns the events' new path, or None when there was none."""
        if resuming or not is_main_process():
            return None
        moved = None
        for name in (EVENTS_FILE, QUARANTINE_FILE):
            old = self.path / name
            if not old.is_file():
                continue
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(old.stat().st_mtime))
            target = self.path / f"{old.stem}.{stamp}{old.suffix}"
            n = 1
            while target.exists():
                n += 1
                target = self.path / f"{old.stem}.{stamp}-{n}{old.suffix}"
            old.replace(target)
            logger.info("an earlier run's %s was moved to %s", name, target.name)  # each moved file said once
            moved = target if name == EVENTS_FILE else moved
        return moved

    def write_json(self, name: str, data) -> Path:
        if is_main_process():
            self._write_json(name, data)
        return self.path / name

    def _write_json(self, name: str, data) -> None:
        self._write_text(name, json.dumps(data, indent=2, ensure_ascii=False, default=str))

    def _write_text(self, name: str, text: str) -> None:
        """Atomic write (temporary file + rename); the temporary file never outlives a failed write."""
        tmp = self.path / f".{name}.tmp"
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(self.path / name)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise

    def _overwrite(self, name: str, text: str) -> None:
        # In place, within the blocks the small file already has: what still works on a full disk.
        with open(self.path / name, "r+b") as fh:
            fh.write(text.encode("utf-8"))
            fh.truncate()

    def finish(self, summary: dict) -> None:
        self.finished = True  # from here on nothing marks the run incomplete (a signal during the last print)
        if is_main_process():
            self._write_json(SUMMARY_FILE, summary)
            (self.path / INCOMPLETE_FILE).unlink(missing_ok=True)

    def fail(self, error: BaseException, description: str | None = None, reason: str | None = None) -> str | None:
        """Record `error` in RUN_INCOMPLETE.json (main process): status "failed", the error (or `description`, what
        it means, e.g. "the disk is full (...)") and `reason` when given. Never raises: returns why it could not be
        recorded, or None."""
        record = {"status": "failed", "started": self.started}
        if reason:
            record["reason"] = reason
        record["error"] = (description or f"{type(error).__name__}: {error}")[:2000]
        return self._record(record)

    def preempted(self, signal_name: str, **fields) -> str | None:
        """Record a stop by `signal_name` in RUN_INCOMPLETE.json (main process): status "preempted" ("interrupted"
        for SIGINT, Ctrl-C), the newest
        complete checkpoint (None: a rerun starts from the beginning) and `fields`. Never raises."""
        found = self._last_complete()
        status = "interrupted" if signal_name == "SIGINT" else "preempted"  # Ctrl-C: a person stopped it
        record = {"status": status, "started": self.started, "signal": signal_name, **fields}
        record.setdefault("checkpoint", str(found) if found else None)
        return self._record(record)

    def _record(self, record: dict) -> str | None:
        if not is_main_process() or not self.path.is_dir() or self.finished:
            return None
        text = json.dumps(record, indent=2, ensure_ascii=False, default=str)
        try:
            self._write_text(INCOMPLETE_FILE, text)
            return None
        except OSError as e:
            first = e
        try:
            self._overwrite(INCOMPLETE_FILE, text)
            return None
        except OSError:
            return f"could not record the failure in {self.path / INCOMPLETE_FILE}: {describe_os_error(first)}"

    def _last_complete(self) -> Path | None:
        try:  # quietly: the failure is the first thing to report, not the incomplete checkpoint it left
            return next((c for c in reversed(list_checkpoints(self.path)) if is_complete(c)), None)
        except OSError:
            return None

    def resume_hint(self) -> str:
        """Which checkpoint the same command would resume from (for a message after a failure)."""
        found = self._last_complete()
        return f"it resumes from {found.name}" if found else "it starts from the beginning (no complete checkpoint)"

    def free_space(self) -> str:
        """e.g. "0 bytes of 800 KiB free"."""
        return describe_free(self.path)


def _labelled(text: str, rank: int) -> str:
    return re.sub(r"^(error: )?", lambda m: f"{m.group(1) or ''}rank {rank}: ", text, count=1)


def _wait_for_launcher(code: int) -> None:
    """A rank other than 0 whose error every rank has: rank 0 prints it, and the launcher ends this rank when rank 0
    exits (SIGTERM: leave quietly with `code`). Returns when that did not happen within FOLLOWER_WAIT_SECONDS (rank
    0 did not stop the same way, or the launcher does not stop the other ranks): then this rank speaks for itself."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum, frame):
        raise SystemExit(code)

    previous = {s: signal.signal(s, leave) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        time.sleep(FOLLOWER_WAIT_SECONDS)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def peer_lost(e: BaseException) -> bool:
    """True when, with several ranks, `e` says another rank left a collective this rank was in."""
    return _world_size() > 1 and any(t in str(err).lower() for err in errors_in_chain(e) for t in _PEER_LOST)


def print_once_per_job(text: str, *, rank_local: bool, code: int) -> None:
    """Print `text` on stderr once per job: with several ranks, rank 0 prints what every rank has (`rank_local`
    False) and each rank prints its own failure, naming its rank (`error: rank 1: ...`)."""
    try:
        rank, world = process_rank(), _world_size()
    except ValueError:  # a launcher's odd environment must not hide the message
        rank, world = 0, 1
    if world > 1 and (rank_local or rank != 0):
        if not rank_local:
            _wait_for_launcher(code)
        text = _labelled(text, rank)
    print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def error_boundary(output: OutputDir | None = None):
    """Turn `HfStableError` into one clear line on stderr and its exit code (2 unless the error says otherwise; no
    traceback wall).

    A full disk (ENOSPC / EDQUOT, however the library that hit it wraps it, or any failed save while the output
    dir's filesystem is nearly full: `hf_stable.full_disk`) is reported first, in one line naming the error, the
    free space and the checkpoint a rerun resumes from, with exit code 1 and no traceback. A termination signal
    outside a training step (`Preempted`, see `stop_on_signals`) marks the run "preempted" and exits with its code;
    Ctrl-C before the handlers exist (a `KeyboardInterrupt`) marks it "interrupted" and exits 130, with one line.
    With several ranks, a rank whose collective lost another rank (gloo "Connection closed by peer") says so in one
    `hf_stable:` line, exit code 1: the rank that left says why. Any other exception is a bug: it is recorded in the
    output dir and re-raised with its traceback. A message is printed once per job (see `print_once_per_job`).
    """
    try:
        yield
    except HfStableError as e:
        # an output dir that cannot be written cannot record its own failure either: the message says so already
        note = output.fail(e, reason=e.reason) if output is not None and not isinstance(e, OutputDirError) else None
        code = e.exit_code
        print_once_per_job(f"error: {e}" + (f"\n  ({note})" if note else ""), rank_local=e.rank_local, code=code)
        raise SystemExit(code) from None
    except Preempted as e:
        note = e.note or "stopped outside a training step: nothing was saved"
        if output is not None:
            output.preempted(e.signal_name, step=None, note=note)
        hint = output.resume_hint() if output is not None else "it starts from the beginning"
        word = "interrupted" if e.signal_name == "SIGINT" else "preempted"
        what = (
            f"{note.partition(':')[0]}, nothing saved" if e.note else f"{e} outside a training step, nothing to save"
        )
        if is_main_process() and not (output is not None and output.finished):
            print(f"\n{word}: {what}; rerun the same command: {hint}")
            sys.stdout.flush()
        raise SystemExit(e.exit_code) from None
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers exist (loading the config, building the base)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # its copy from the launcher must not interrupt this exit
        note = "Ctrl-C before training: nothing was saved"
        if output is not None:
            output.preempted("SIGINT", step=None, note=note)
        if is_main_process() and not (output is not None and output.finished):
            hint = output.resume_hint() if output is not None else "it starts from the beginning"
            print(
                f"\ninterrupted: Ctrl-C before training, nothing to save; rerun the same command: {hint}", flush=True
            )
        raise SystemExit(130) from None
    except SystemExit:
        raise
    except BaseException as e:
        if output is not None and disk_full(e, output.path):
            what = f"the disk is full ({type(e).__name__}: {str(e)[:500]}); {output.free_space()} under {output.path}"
            print_once_per_job(
                f"error: {what}. Free space and rerun the same command: {output.resume_hint()}",
                rank_local=True,
                code=1,
            )
            note = output.fail(e, description=what, reason="disk full")
            if note:
                print(f"  ({note})", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        if peer_lost(e):  # the rank that left says why (its own error: line, or its traceback)
            rank, what = process_rank(), f"{type(e).__name__}: {str(e)[:300]}"
            if output is not None:
                output.fail(
                    e, f"another rank stopped, rank {rank} lost it in a collective ({what})", "another rank stopped"
                )
            print(
                f"hf_stable: rank {rank} stopped: another rank left a collective ({what}); that rank's message says why",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1) from None
        note = output.fail(e) if output is not None else None
        if note:
            print(f"hf_stable: {note}", file=sys.stderr, flush=True)
        raise
