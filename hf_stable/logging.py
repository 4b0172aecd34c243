"""Logging that prints on the main process only.

Library code calls `get_logger(__name__)`. Every rank computes the same things, but only the main
process prints, so a 2-rank run does not show every message twice.
"""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def process_rank() -> int:
    """This process's global rank (0 when not distributed). Reads the launcher's env, so it works before init."""
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def is_main_process() -> bool:
    """True on global rank 0 (or when not distributed). Reads the launcher's env, so it works before init."""
    return process_rank() == 0


class _MainProcessFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_main_process()


def get_logger(name: str) -> logging.Logger:
    global _CONFIGURED
    root = logging.getLogger("hf_stable")
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[hf_stable] %(levelname)s %(message)s"))
        handler.addFilter(_MainProcessFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("HF_STABLE_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        _CONFIGURED = True
    if not name.startswith("hf_stable"):
        name = f"hf_stable.{name}"
    return logging.getLogger(name)


def print_main(*args, **kwargs) -> None:
    """`print` on the main process only."""
    if is_main_process():
        print(*args, **kwargs, flush=True)
