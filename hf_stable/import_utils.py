"""Availability checks for optional extras; heavy imports stay inside the functions that need them."""

from __future__ import annotations

import importlib.util
from functools import cache

from hf_stable.errors import MissingDependencyError

_EXTRA_OF = {
    "flash_attn": "flash",
    "deepspeed": "deepspeed",
    "pynvml": "nvml",
    "tensorboard": "tensorboard",
    "bitsandbytes": "bitsandbytes",
}


@cache
def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def is_flash_attn_available() -> bool:
    return _has("flash_attn")


def is_deepspeed_available() -> bool:
    return _has("deepspeed")


def is_nvml_available() -> bool:
    return _has("pynvml")


def is_tensorboard_available() -> bool:
    return _has("tensorboard")


def is_bitsandbytes_available() -> bool:
    return _has("bitsandbytes")


def require(module: str, what: str) -> None:
    """Raise a `MissingDependencyError` with the exact install line when `module` is missing."""
    if not _has(module):
        extra = _EXTRA_OF.get(module, "dev")
        raise MissingDependencyError(
            f"{what} needs the '{module}' package, which is not installed. "
            f'Install it with: pip install "hf-stable[{extra}]"'
        )
