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


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on the stderr of its creation that moves to the current one if that stream was closed (a
    stream swapped in for a while, e.g. by pytest's capsys, must not turn every later line into a logging error)."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self.stream, "closed", False):
            self.stream = sys.stderr if not getattr(sys.stderr, "closed", False) else sys.__stderr__
        super().emit(record)


def get_logger(name: str) -> logging.Logger:
    global _CONFIGURED
    root = logging.getLogger("hf_stable")
    if not _CONFIGURED:
        handler = _StderrHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[hf_stable] %(levelname)s %(message)s"))
        handler.addFilter(_MainProcessFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("HF_STABLE_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        _CONFIGURED = True
    if not name.startswith("hf_stable"):
        name = f"hf_stable.{name}"
    return logging.getLogger(name)


# bitsandbytes (imported by peft) tries to load an optional fused CPU 4-bit kernel from the `kernels` package when it
# is imported, and warns when that package is not installed - the first line of every run, although only a 4-bit
# model on CPU would use the kernel (bitsandbytes falls back without it).
BNB_CPU_OPS_LOGGER = "bitsandbytes.backends.cpu.ops"
_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class OptionalKernelsNotice(logging.Filter):
    """Drops bitsandbytes' import-time warning that the optional `kernels` package is not installed, and nothing
    else: the same warning for any other failure (a broken `kernels` install, a kernel that will not load) still
    shows. `dropped` keeps the text, so a run that does load a 4-bit model on CPU can say it (`modeling`)."""

    def __init__(self):
        super().__init__()
        self.dropped: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        missing = any(isinstance(a, ModuleNotFoundError) and a.name == "kernels" for a in args)
        if missing and str(record.msg).startswith(_KERNELS_NOTICE):
            self.dropped = record.getMessage()
            return False
        return True


def optional_kernels_notice() -> OptionalKernelsNotice:
    """The filter on bitsandbytes' CPU-ops logger, installed once (before bitsandbytes is imported: `hf_stable`'s
    import installs it)."""
    logger = logging.getLogger(BNB_CPU_OPS_LOGGER)
    for f in logger.filters:
        if isinstance(f, OptionalKernelsNotice):
            return f
    f = OptionalKernelsNotice()
    logger.addFilter(f)
    return f


def say_on_this_rank(message: str) -> None:
    """Print what only this process knows or does (a build one rank makes for all, a wait on another rank), on any
    rank (the hf_stable logger prints on rank 0 only), labelled with the rank when several were launched."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 or not is_main_process()
    text = f"rank {process_rank()}: {message}" if launched else message
    if is_main_process():
        get_logger("hf_stable").info(text)
    else:
        print(f"[hf_stable] {text}", file=sys.stderr, flush=True)


def print_main(*args, **kwargs) -> None:
    """`print` on the main process only."""
    if is_main_process():
        print(*args, **kwargs, flush=True)
