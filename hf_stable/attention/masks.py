"""Masks in the forms each backend needs, derived from what transformers hands the attention function.

transformers gives us a 4D boolean mask (our mask function is its `sdpa_mask`: True = attend) or None when
the pattern is plain causal. Packed batches from a flattening collator additionally carry
`cu_seq_lens_q/k`; when position ids were passed too, the 4D mask is already block-causal, otherwise the
mask is None and only `cu_seq_lens` tells where samples end — so every path that does not use transformers'
own SDPA call rebuilds the pattern from `cu_seq_lens` here, instead of letting samples see each other.

Flash-attn wants the opposite representation: unpadded tokens plus `cu_seqlens`. `varlen_layout` recovers
it from a 4D mask (padding and packing alike) and checks that the mask is exactly block-causal (with the
sliding window, if any); a mask that is not (a custom pattern) returns None and the caller falls back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


def segment_ids(cu_seqlens: torch.Tensor, length: int, device) -> torch.Tensor:
    """Sample index of each of `length` packed tokens (tokens past the last boundary get their own id)."""
    positions = torch.arange(length, device=device)
    return torch.searchsorted(cu_seqlens[1:].to(device=device, dtype=torch.long), positions, right=True)


def allowed_rows(
    mask: torch.Tensor | None,
    rows: slice,
    q_len: int,
    k_len: int,
    device,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """Boolean "may attend" pattern for query rows `rows`, shaped to broadcast as `[B|1, 1|H, rows, k_len]`.

    A given 4D mask is used as is (bool, or additive float where finite-and-not-minimal means allowed). With
    no mask, the pattern is rebuilt: causal (aligned bottom-right when keys outnumber queries, as with a
    cache), restricted to each packed sample by `cu_seqlens`, and to `sliding_window` keys. Returns None when
    everything is allowed (non-causal, unpacked, no window).
    """
    if mask is not None:
        part = mask[..., rows, :]
        if part.dtype != torch.bool:
            part = part > torch.finfo(part.dtype).min / 2
        return part
    q_idx = torch.arange(rows.start, rows.stop, device=device)[:, None] + (k_len - q_len)
    k_idx = torch.arange(k_len, device=device)[None, :]
    allowed = None
    if causal:
        allowed = k_idx <= q_idx
    if sliding_window is not None:
        win = k_idx > q_idx - sliding_window
        allowed = win if allowed is None else allowed & win
    if cu_seqlens is not None and q_len == k_len:
        seg = segment_ids(cu_seqlens, k_len, device)
        same = seg[rows][:, None] == seg[None, :]
        allowed = same if allowed is None else allowed & same
    return None if allowed is None else allowed[None, None]


def per_group(pattern: torch.Tensor, heads: int, kv_heads: int, groups: int) -> torch.Tensor:
    """A `[B, 1|H, q, k]` mask or bias viewed to broadcast against `[B, KV, G, q, k]` (GQA-grouped) logits."""
    if pattern.shape[1] == heads and heads > 1:
        return pattern.reshape(pattern.shape[0], kv_heads, groups, *pattern.shape[-2:])
    return pattern.unsqueeze(2)


@dataclass
class VarlenLayout:
    """Where the real tokens of a padded and/or packed `[B, T]` batch sit once flattened."""

    indices: torch.Tensor  # positions in the flattened B*T tokens that take part
    cu_seqlens: torch.Tensor  # int32 boundaries of each sample among those tokens
    max_seqlen: int


def varlen_layout(mask: torch.Tensor, sliding_window: int | None = None) -> VarlenLayout | None:
    """Recover samples from a 4D `[B, 1, T, T]` boolean mask, or None if it is not block-causal.

    A token is real when it may attend to itself (the diagonal); a sample starts at a real token that may not
    attend to its predecessor. The mask rebuilt from those samples must equal the given one on every real
    query row, which rules out patterns flash-attn's varlen call cannot express.
    """
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
        return None
    grid = mask[:, 0]
    batch, length = grid.shape[0], grid.shape[-1]
    valid = grid.diagonal(dim1=-2, dim2=-1)
    sees_prev = torch.zeros_like(valid)
    sees_prev[:, 1:] = grid.diagonal(offset=-1, dim1=-2, dim2=-1)
    starts = valid & ~sees_prev
    seg = torch.cumsum(starts.to(torch.int32), dim=-1)
    q_idx = torch.arange(length, device=mask.device)
    rebuilt = (seg[:, :, None] == seg[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    rebuilt &= q_idx[None, :] <= q_idx[:, None]
    if sliding_window is not None:
        rebuilt &= q_idx[None, :] > q_idx[:, None] - sliding_window
    # Rows of padding queries are ignored: their outputs are never used (flash leaves them zero).
    if not bool(torch.equal(rebuilt, grid.expand(batch, length, length) & valid[:, :, None])):
        return None
    flat_valid = valid.reshape(-1)
    indices = flat_valid.nonzero().squeeze(1)
    start_pos = starts.reshape(-1)[indices].nonzero().squeeze(1)
    total = torch.tensor([indices.numel()], device=mask.device, dtype=start_pos.dtype)
    cu = torch.cat([start_pos, total]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    return VarlenLayout(indices=indices, cu_seqlens=cu, max_seqlen=max_seqlen)


class LayoutCache:
    """Remembers the layouts of the last few masks: one forward builds one mask shared by all its layers.

    Masks are held by weak reference, so a cached layout never keeps a `B x T x T` mask alive.
    """

    def __init__(self, size: int = 4):
        self._size = size
        self._entries: list[tuple[weakref.ref, int | None, VarlenLayout | None]] = []

    def get(self, mask: torch.Tensor, sliding_window: int | None) -> VarlenLayout | None:
        for held, window, layout in self._entries:
            if held() is mask and window == sliding_window:
                return layout
        layout = varlen_layout(mask, sliding_window)
        live = [e for e in self._entries if e[0]() is not None]
        self._entries = [(weakref.ref(mask), sliding_window, layout)] + live[: self._size - 1]
        return layout

    def clear(self) -> None:
        self._entries = []
