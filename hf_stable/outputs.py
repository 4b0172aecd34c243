"""The run's output directory: what marks a run finished, and the recipe's error boundary.

A run is finished only when `run_summary.json` exists. At start, stale finish markers from an earlier
run in the same directory are removed and `RUN_INCOMPLETE.json` is written; it is replaced by the
summary on success and records the error on failure, so a crashed run never looks finished.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import yaml

from hf_stable.errors import HfStableError
from hf_stable.logging import is_main_process

SUMMARY_FILE = "run_summary.json"
INCOMPLETE_FILE = "RUN_INCOMPLETE.json"
CONFIG_FILE = "resolved_config.yaml"
FINISH_MARKERS = (SUMMARY_FILE, "README.md")


class OutputDir:
    """Lifecycle of one run's output directory (writes happen on the main process only)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.started = time.time()

    def start(self, config: dict) -> OutputDir:
        if is_main_process():
            self.path.mkdir(parents=True, exist_ok=True)
            for name in FINISH_MARKERS:
                (self.path / name).unlink(missing_ok=True)
            self._write_json(INCOMPLETE_FILE, {"status": "running", "started": self.started})
            with open(self.path / CONFIG_FILE, "w", encoding="utf-8") as fh:
                yaml.safe_dump(config, fh, sort_keys=False, allow_unicode=True)
        return self

    def set_aside_events(self, resuming: bool) -> Path | None:
        """A fresh run (not a resume) into a directory that holds an earlier run's `stability_events.jsonl`:
        rename that file to `stability_events.<time>.jsonl` so the report and model card show this run's events
        only, and nothing is lost. Returns the new path, or None when there was nothing to move."""
        from hf_stable.callbacks.events import EVENTS_FILE

        old = self.path / EVENTS_FILE
        if resuming or not is_main_process() or not old.is_file():
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(old.stat().st_mtime))
        target = self.path / f"{old.stem}.{stamp}{old.suffix}"
        n = 1
        while target.exists():
            n += 1
            target = self.path / f"{old.stem}.{stamp}-{n}{old.suffix}"
        old.replace(target)
        return target

    def write_json(self, name: str, data) -> Path:
        if is_main_process():
            self._write_json(name, data)
        return self.path / name

    def _write_json(self, name: str, data) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str))
        tmp.replace(self.path / name)

    def finish(self, summary: dict) -> None:
        if is_main_process():
            self._write_json(SUMMARY_FILE, summary)
            (self.path / INCOMPLETE_FILE).unlink(missing_ok=True)

    def fail(self, error: BaseException) -> None:
        if is_main_process() and self.path.is_dir():
            self._write_json(
                INCOMPLETE_FILE,
                {"status": "failed", "started": self.started, "error": f"{type(error).__name__}: {error}"},
            )


@contextlib.contextmanager
def error_boundary(output: OutputDir | None = None):
    """Turn `HfStableError` into one clear line on stderr and exit code 2 (no traceback wall).

    Any other exception is a bug: it is recorded in the output dir and re-raised with its traceback.
    """
    try:
        yield
    except HfStableError as e:
        if output is not None:
            output.fail(e)
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except BaseException as e:
        if output is not None and not isinstance(e, SystemExit):
            output.fail(e)
        raise
