"""The `hf_stable` attention function and its registration with transformers.

transformers v5 looks attention functions up by name in `AttentionInterface` and builds the mask with the
function registered under the same name in `AttentionMaskInterface`. Registering only the former makes the
model call us with `attention_mask=None`, which silently breaks padding and packing, so `register()` does
both. Our mask function is transformers' `sdpa_mask` (4D boolean, or None for plain causal): it is what the
SDPA path needs verbatim, and the other paths derive their own forms from it (see `masks.py`).

Per call, the function (1) feeds the logit probe when a callback armed it, (2) picks a backend, (3) runs it.
With no soft-cap, no armed probe and no CUDA flash, step (3) is transformers' SDPA function itself.
"""

from __future__ import annotations

import collections

import torch

from hf_stable.attention import kernels
from hf_stable.attention.masks import allowed_rows
from hf_stable.attention.probe import get_probe
from hf_stable.attention.settings import AttentionSettings, configure, current_settings
from hf_stable.config.attention import ATTN_IMPLEMENTATION
from hf_stable.errors import HfStableError, MissingDependencyError
from hf_stable.import_utils import is_flash_attn_available
from hf_stable.logging import get_logger

logger = get_logger(__name__)

_HALF = (torch.float16, torch.bfloat16)
_USAGE: collections.Counter = collections.Counter()
_LOGGED: set = set()
_PROBE = get_probe()


def _note(backend: str, why: str) -> None:
    if torch.compiler.is_compiling():
        # diagnostics stay out of a compiled graph: the log call would break it, and counting would guard on the
        # count (a recompile every call); compiled calls are not counted
        return
    _USAGE[backend] += 1
    if (backend, why) not in _LOGGED:
        _LOGGED.add((backend, why))
        logger.info("hf_stable attention: %s backend (%s)", backend, why)


def backend_usage() -> dict[str, int]:
    """How many eager attention calls each backend served since the last reset (diagnostics, tests, GPU check)."""
    return dict(_USAGE)


def reset_backend_usage() -> None:
    _USAGE.clear()


def _flash_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half dtype flash-attn would run in: the query's own, or autocast's when RoPE promoted q to fp32."""
    if query.dtype in _HALF:
        return query.dtype
    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return dtype if dtype in _HALF else None
    return None


def _auto_flash_ok(query: torch.Tensor, cap: float | None) -> bool:
    return (
        query.is_cuda
        and query.shape[-1] <= 256
        and _flash_dtype(query) is not None
        and is_flash_attn_available()
        and (cap is None or kernels.flash_supports_softcap())
    )


def hf_stable_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: query `[B, H, q, D]`, key/value `[B, KV, k, D]` → `[B, q, H, D]`.

    Raises:
        HfStableError: backend "flash" forced with fp32 tensors.
        MissingDependencyError: backend "flash" forced without flash-attn installed.
    """
    settings = current_settings()
    cap = softcap if softcap is not None else settings.softcap  # a model's own cap (Gemma-style) wins
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    is_causal = kwargs.get("is_causal")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    cu_q = kwargs.get("cu_seq_lens_q")
    # Packed without position ids: transformers built no block mask, only cu_seq_lens knows the boundaries.
    packed_cu = cu_q if attention_mask is None and cu_q is not None and query.shape[0] == 1 else None

    if _PROBE.armed and module.training:
        _PROBE.observe(
            module,
            query,
            key,
            attention_mask,
            scaling,
            causal=causal,
            cu_seqlens=packed_cu,
            sliding_window=sliding_window,
        )

    backend = settings.backend
    if backend == "flash" or (backend == "auto" and _auto_flash_ok(query, cap)):
        out = _run_flash(
            query,
            key,
            value,
            attention_mask,
            forced=backend == "flash",
            scaling=scaling,
            dropout=dropout,
            cap=cap,
            causal=causal,
            sliding_window=sliding_window,
            kwargs=kwargs,
        )
        if out is not None:
            return out
    if backend == "eager" or cap is not None:
        _note("explicit", "soft-cap needs materialised logits" if cap is not None else "forced by settings")
        return kernels.explicit_forward(
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            training=module.training,
            softcap=cap,
            causal=causal,
            cu_seqlens=packed_cu,
            sliding_window=sliding_window,
        )
    if packed_cu is not None and query.shape[2] == key.shape[2]:
        attention_mask = allowed_rows(
            None,
            slice(0, query.shape[2]),
            query.shape[2],
            key.shape[2],
            query.device,
            causal=causal,
            cu_seqlens=packed_cu,
            sliding_window=sliding_window,
        )
        _note("sdpa", "packed batch without position_ids: block mask rebuilt from cu_seq_lens")
    else:
        _note("sdpa", "no CUDA flash-attn for these tensors" if backend == "auto" else "forced by settings")
    return kernels.sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _run_flash(query, key, value, mask, *, forced, scaling, dropout, cap, causal, sliding_window, kwargs):
    dtype = _flash_dtype(query)
    if forced:
        try:
            kernels.flash_functions()
        except ImportError:
            raise MissingDependencyError(
                "attention.backend: 'flash' needs the flash-attn package, which is not importable. Install it "
                'with: pip install "hf-stable[flash]", or set attention.backend: auto'
            ) from None
        if dtype is None:
            raise HfStableError(
                f"attention.backend: 'flash' needs float16/bfloat16 tensors, got {query.dtype}. Load the model "
                "with model.dtype: bfloat16 (or train with bf16), or set attention.backend: auto"
            )
        if cap is not None and not kernels.flash_supports_softcap():
            raise HfStableError(
                "attention.softcap: the installed flash-attn has no softcap argument (needs >= 2.6); upgrade it "
                "or set attention.backend: auto to soft-cap on the explicit path"
            )
    out = kernels.flash_forward(
        query,
        key,
        value,
        mask,
        scaling=scaling,
        dtype=dtype,
        dropout=dropout,
        softcap=cap,
        causal=causal,
        sliding_window=sliding_window,
        cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
        cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
        max_length_q=kwargs.get("max_length_q"),
        max_length_k=kwargs.get("max_length_k"),
    )
    if out is None:
        _note("sdpa", "mask pattern not expressible for flash-attn varlen; fell back")
        return None
    packed = kwargs.get("cu_seq_lens_q") is not None or mask is not None
    _note("flash", f"flash-attn 2 {'varlen' if packed else 'dense'} in {dtype}")
    return out


def register(config: AttentionSettings | object | None = None) -> AttentionSettings:
    """Register `"hf_stable"` with transformers (attention function **and** mask function); idempotent.

    Args:
        config: optional `AttentionSettings`, or an `AttentionConfig` section (its `backend` and `softcap`),
            which become the active settings. None keeps the current settings.

    Returns:
        The active settings.

    Example:
        >>> from hf_stable.attention import register
        >>> register(cfg.attention)
        >>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_stable")
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if config is not None:
        configure(config if isinstance(config, AttentionSettings) else AttentionSettings.from_config(config))
    if AttentionInterface().get(ATTN_IMPLEMENTATION) is not hf_stable_attention_forward:
        AttentionInterface.register(ATTN_IMPLEMENTATION, hf_stable_attention_forward)
    if AttentionMaskInterface().get(ATTN_IMPLEMENTATION) is not sdpa_mask:
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return current_settings()


def is_registered() -> bool:
    """True when both halves of the registration are in place."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return (
        AttentionInterface().get(ATTN_IMPLEMENTATION) is hf_stable_attention_forward
        and ATTN_IMPLEMENTATION in AttentionMaskInterface()
    )
