"""The three ways the `hf_stable` attention function computes attention.

* `sdpa`: transformers' own SDPA function, called unchanged, so with every feature off the result is
  bit-for-bit what `attn_implementation="sdpa"` gives (that is the equality contract).
* `explicit`: logits materialised in float32 (or float64 for gradcheck), optional soft-cap, masked
  softmax in float32. SDPA cannot soft-cap, so this is the CPU / no-flash path when soft-capping is on.
* `flash`: flash-attn 2. Dense causal call when nothing is masked; `flash_attn_varlen_func` with
  `cu_seqlens` for packed batches (taken from the collator's `cu_seq_lens_q/k` when present) and for padded
  batches (unpadded from the 4D mask). flash-attn soft-caps natively when its version supports it.

All return `(output [B, q, H, D], None)` like transformers' functions.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_stable.attention.masks import LayoutCache, allowed_rows, per_group

__all__ = ["explicit_forward", "flash_forward", "flash_functions", "flash_supports_softcap", "sdpa_forward"]

sdpa_forward = sdpa_attention_forward

_LAYOUTS = LayoutCache()


def explicit_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
    softcap: float | None = None,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, None]:
    """Attention with the logits and softmax in at least float32; GQA without copying keys per query head.

    Query rows that may attend to nothing (padding) produce zeros, as flash-attn and SDPA do, instead of the
    uniform average an additive-minimum mask would give; their gradients are zero and finite.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    work = torch.promote_types(query.dtype, torch.float32)
    q5 = query.to(work).reshape(batch, kv_heads, groups, q_len, dim)
    logits = torch.matmul(q5, key.to(work).unsqueeze(2).transpose(-1, -2)) * scaling  # [B, KV, G, q, k]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None and mask.dtype != torch.bool:  # an additive bias (custom 4D masks)
        logits = logits + per_group(mask.to(work), heads, kv_heads, groups)
    allowed = allowed_rows(
        mask,
        slice(0, q_len),
        q_len,
        k_len,
        query.device,
        causal=causal,
        cu_seqlens=cu_seqlens,
        sliding_window=sliding_window,
    )
    row_live = None
    if allowed is not None:
        allowed = per_group(allowed, heads, kv_heads, groups)
        logits = logits.masked_fill(~allowed, torch.finfo(work).min)
        row_live = allowed.any(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)
    if row_live is not None:
        probs = probs * row_live
    if dropout > 0.0 and training:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs.to(value.dtype), value.unsqueeze(2))  # [B, KV, G, q, D]
    out = out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous()
    return out.to(query.dtype), None


def flash_functions():
    """`(flash_attn_func, flash_attn_varlen_func)`; raises ImportError when flash-attn is missing."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func


@lru_cache(maxsize=8)
def _accepts_softcap(fn) -> bool:
    try:
        return "softcap" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def flash_supports_softcap() -> bool:
    """True when the installed flash-attn takes a `softcap` argument (flash-attn >= 2.6)."""
    try:
        dense, varlen = flash_functions()
    except ImportError:
        return False
    return _accepts_softcap(dense) and _accepts_softcap(varlen)


def _scalar(value) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _longest(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float,
    dtype: torch.dtype,
    dropout: float = 0.0,
    softcap: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q=None,
    max_length_k=None,
) -> tuple[torch.Tensor, None] | None:
    """flash-attn 2 in `dtype` (fp16/bf16). Returns None when the mask is a pattern varlen cannot express."""
    dense, varlen = flash_functions()
    out_dtype = query.dtype
    q = query.transpose(1, 2).to(dtype)  # flash wants [B, T, H, D]
    k = key.transpose(1, 2).to(dtype)
    v = value.transpose(1, 2).to(dtype)
    batch, q_len, heads, dim = q.shape
    extra = {"dropout_p": dropout, "softmax_scale": scaling, "causal": causal}
    if sliding_window is not None:
        extra["window_size"] = (sliding_window - 1, 0)  # transformers' window counts the query itself
    if softcap is not None:
        extra["softcap"] = softcap

    if cu_seq_lens_q is not None and batch == 1:
        cu_k = cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q
        out = varlen(
            q[0],
            k[0],
            v[0],
            cu_seqlens_q=cu_seq_lens_q.to(torch.int32),
            cu_seqlens_k=cu_k.to(torch.int32),
            max_seqlen_q=_scalar(max_length_q) if max_length_q is not None else _longest(cu_seq_lens_q),
            max_seqlen_k=_scalar(max_length_k) if max_length_k is not None else _longest(cu_k),
            **extra,
        )
        return out.unsqueeze(0).to(out_dtype), None
    if mask is None:
        return dense(q, k, v, **extra).to(out_dtype), None
    if q_len != k.shape[1]:
        return None  # a padded mask with a cache (generation): leave it to SDPA
    layout = _LAYOUTS.get(mask, sliding_window)
    if layout is None:
        return None
    idx = layout.indices
    out_u = varlen(
        q.reshape(batch * q_len, heads, dim).index_select(0, idx),
        k.reshape(batch * q_len, k.shape[2], dim).index_select(0, idx),
        v.reshape(batch * q_len, v.shape[2], v.shape[-1]).index_select(0, idx),
        cu_seqlens_q=layout.cu_seqlens,
        cu_seqlens_k=layout.cu_seqlens,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_k=layout.max_seqlen,
        **extra,
    )
    full = out_u.new_zeros(batch * q_len, heads, v.shape[-1]).index_copy(0, idx, out_u)
    return full.view(batch, q_len, heads, v.shape[-1]).to(out_dtype), None
