"""Is a failure a full disk? The errno, the words, or - when a save failed with anything else - the free space.

Libraries report a full disk in different ways: Python's own writes raise `OSError(ENOSPC)` (or `EDQUOT`),
safetensors' Rust writer raises `IoError(Os { code: 28, kind: StorageFull, ... })`, and torch's zip writer
(`torch.save`) raises `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos N vs M` (or
`basic_ios::clear: iostream error`), with no errno and no word of the disk. So a save that fails, whatever the
exception, is a full disk when the target's filesystem is (nearly) full right after it: a write to a full disk
takes what is left before it fails, so the free space is then a few blocks at most.

A "save" is an exception raised inside a function whose name starts with "save" (`torch.save`, `save_file`,
`Trainer._save_checkpoint`, `save_model`, `save_pretrained`, `savefig`, ...; not `_maybe_log_save_evaluate`, which
also evaluates). An error anywhere else (a shape mismatch in the forward) stays a bug with its traceback, however
full the disk.
"""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how a full disk reads in errors that carry no errno (safetensors' Rust IoError, "Disk quota exceeded" text)
_FULL_TEXT = ("nospaceleftondevice", "storagefull", "diskquotaexceeded")
# "nearly full": at most this share of the filesystem free, and never more than NEARLY_FULL_BYTES
NEARLY_FULL_SHARE = 0.01
NEARLY_FULL_BYTES = 64 * 2**20
_SAVING = re.compile(r"^_*save")


def errors_in_chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def says_disk_full(e: BaseException) -> bool:
    """True when `e` (or an error it was raised from) says the disk or the quota is full (errno or text)."""
    for err in errors_in_chain(e):
        if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
            return True
        if any(text in str(err).lower().replace(" ", "") for text in _FULL_TEXT):
            return True
    return False


def raised_while_saving(e: BaseException) -> bool:
    """True when `e` (or an error it was raised from) was raised inside a function whose name starts with "save"."""
    for err in errors_in_chain(e):
        tb = err.__traceback__
        while tb is not None:
            if _SAVING.match(tb.tb_frame.f_code.co_name.lower()):
                return True
            tb = tb.tb_next
    return False


def _usage(path: Path):
    path = Path(path)
    while not path.exists() and path != path.parent:  # the directory may not exist yet: ask its filesystem
        path = path.parent
    return shutil.disk_usage(path)


def nearly_full(path: str | Path) -> bool:
    """True when the filesystem holding `path` has at most 1 % (and at most 64 MiB) free to this user."""
    try:
        usage = _usage(Path(path))
    except OSError:
        return False
    return usage.free <= min(NEARLY_FULL_BYTES, NEARLY_FULL_SHARE * usage.total)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def describe_free(path: str | Path) -> str:
    """e.g. "0 bytes of 800 KiB free" for the filesystem holding `path`."""
    try:
        usage = _usage(Path(path))
    except OSError:
        return "free space unknown"
    return f"{_size(usage.free)} of {_size(usage.total)} free"


def disk_full(e: BaseException, target: str | Path | None = None) -> bool:
    """True when `e` is a full disk: it says so (errno, text), or it was raised while saving and `target`'s
    filesystem is nearly full now.

    Example:
        >>> disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 0"), out_dir)
    """
    if says_disk_full(e):
        return True
    return target is not None and raised_while_saving(e) and nearly_full(target)
