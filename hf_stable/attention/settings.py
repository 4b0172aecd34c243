"""`AttentionSettings`: the process-wide switches read by the `hf_stable` attention function.

Why process-wide: transformers calls an attention function with the module and tensors only, so the
function cannot receive our options per call. Keeping them in one small object (set by `register()` or
`configure()`) avoids writing private keys into the model's config, which would leak into saved
config.json files. Tests and benchmarks switch settings temporarily with `use_settings(...)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Literal

from hf_stable.config.attention import AttentionConfig, kernel_problems
from hf_stable.errors import ConfigError

Backend = Literal["auto", "flash", "sdpa", "eager"]


@dataclass
class AttentionSettings:
    """Options of the `hf_stable` attention implementation.

    Args:
        backend: "auto" picks flash-attn 2 on CUDA with fp16/bf16 when installed, else SDPA (or the explicit fp32
            softmax path when soft-capping needs it). "flash", "sdpa" and "eager" (the explicit path) force one;
            forcing "flash" without flash-attn or with fp32 inputs raises.
        softcap: when set, logits become `softcap * tanh(logits / softcap)` before the softmax (50.0 is the usual
            value). None turns it off.

    Raises:
        ConfigError: a value out of range.

    Example:
        >>> from hf_stable.attention import register, AttentionSettings
        >>> register(AttentionSettings(softcap=50.0))  # then attn_implementation="hf_stable"
    """

    backend: Backend = AttentionConfig.backend  # the defaults are the config section's
    softcap: float | None = AttentionConfig.softcap

    def __post_init__(self):
        problems = kernel_problems(self.backend, self.softcap)
        if problems:
            raise ConfigError(problems, source="AttentionSettings")

    @classmethod
    def from_config(cls, cfg) -> AttentionSettings:
        """Settings from an `AttentionConfig` section (or anything with `backend` / `softcap` attributes)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


_CURRENT = AttentionSettings()


def current_settings() -> AttentionSettings:
    """The settings the attention function uses right now."""
    return _CURRENT


def configure(settings: AttentionSettings | None = None, **changes) -> AttentionSettings:
    """Replace the active settings (or change some fields of them). Returns the new settings."""
    global _CURRENT
    base = settings if settings is not None else _CURRENT
    _CURRENT = dataclasses.replace(base, **changes) if changes else base
    return _CURRENT


@contextlib.contextmanager
def use_settings(settings: AttentionSettings | None = None, **changes):
    """Temporarily switch settings (tests, benchmarks); the previous ones come back on exit."""
    global _CURRENT
    previous = _CURRENT
    try:
        yield configure(settings, **changes)
    finally:
        _CURRENT = previous
