"""`LogitProbe`: the sampled per-layer, per-head maximum of the pre-softmax attention logits.

Attention-logit growth is a known precursor of divergence, but materialising logits every step would
cost the fused kernels their advantage. So the probe is *armed* by a callback only on sampled steps; on
every other step the attention function checks one boolean and runs the plain kernel. When armed, each
layer computes `max(q·k·scaling)` over the positions the mask lets it attend to, in query chunks (never a
full `B x H x T x T` tensor) without gradients, and keeps the result on the device. `read()` stacks all
layers and moves them to the host with a single `.tolist()` (after an all-reduce MAX when distributed, so
every rank sees, and acts on, the same numbers).

The logit is the raw scaled dot product, before any soft-cap: the cap bounds what the softmax sees, and
the raw value is what QK-clip has to keep under its threshold.
"""

from __future__ import annotations

import weakref

import torch

from hf_stable.attention.masks import allowed_rows, per_group


@torch.no_grad()
def head_max_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_elements: int = 1 << 26,
) -> torch.Tensor:
    """Per query head max of `scaling * q·k` over allowed (query, key) pairs, as float32 `[H]` on the device.

    Args:
        query: `[B, H, q, D]`.
        key: `[B, KV, k, D]`; each key head serves `H // KV` consecutive query heads (GQA).
        mask: 4D pattern given to the attention function, or None (see `masks.allowed_rows`).
        chunk_elements: bound on the logits held at once; queries are processed in row blocks.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if scaling > 0 and batch * heads * q_len * k_len <= chunk_elements:
        where = _ALLOWED.get(mask, batch, heads, q_len, k_len)
        if where is not None:  # the allowed pairs of a one-chunk pattern, listed once per mask (not per layer)
            return _gathered_max(query, key, where, scaling)
    # fp32 logits; on CUDA, half-precision inputs keep their dtype for the matmul (tensor cores, fp32
    # accumulation) and the maximum carries bf16/fp16 output rounding (~0.4 %), fine for a monitor.
    work = query.dtype if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else torch.float32
    q5 = query.detach().to(work).reshape(batch, kv_heads, groups, q_len, dim)
    kt = key.detach().to(work).unsqueeze(2).transpose(-1, -2)  # [B, KV, 1, D, k]
    rows_per_chunk = max(1, chunk_elements // max(1, batch * heads * k_len))
    best = torch.full((kv_heads, groups), float("-inf"), device=query.device)
    # Padding queries still attend to real keys under transformers' masks (only keys are masked); their
    # logits are never used, so they are left out: a query is real when it may attend to itself.
    real_rows = None
    if mask is not None and mask.dtype == torch.bool and q_len == k_len:
        real_rows = mask.diagonal(dim1=-2, dim2=-1)[..., None]  # [B, 1|H, q, 1]
    # A positive scaling is applied to the maxima, not to every logit: rounding `scaling * x` is monotonic in x, so
    # the max of the scaled logits and the scaled max are the same float (one pass over the logits fewer).
    late = scaling > 0
    for start in range(0, q_len, rows_per_chunk):
        rows = slice(start, min(q_len, start + rows_per_chunk))
        logits = torch.matmul(q5[:, :, :, rows], kt).float()  # [B, KV, G, r, k]
        if not late:
            logits = logits * scaling
        allowed = allowed_rows(
            mask, rows, q_len, k_len, query.device, causal=causal, cu_seqlens=cu_seqlens, sliding_window=sliding_window
        )
        if real_rows is not None:
            allowed = allowed & real_rows[..., rows, :]
        if allowed is not None:  # in place: the chunk's logits are ours
            logits.masked_fill_(~per_group(allowed, heads, kv_heads, groups), float("-inf"))
        best = torch.maximum(best, logits.amax(dim=(0, 3, 4)))
    return (best * scaling if late else best).reshape(heads)


_GATHER_LIMIT = 1 << 21  # index entries (int64, 16 MiB) a pair list may hold; larger patterns take the chunked path


class AllowedPairs:
    """The flat positions, in `[B, H, q, k]` logits, of every (query head, allowed pair) of the last few masks.

    One forward builds one mask and hands it to every layer, so the pattern is turned into indices once per
    forward instead of being sliced, combined and broadcast over each layer's logits (on CPU, where the small ops
    this saves cost most; on an accelerator the count of pairs would be a host sync). Only a boolean 4D mask shared
    by all heads and given per row (`[B, 1, q, k]`, transformers' own) with queries and keys aligned is listed;
    masks are held by weak reference (a cached list never keeps a `B x T x T` mask alive).
    """

    def __init__(self, size: int = 2):
        self._size = size
        self._entries: list[tuple[weakref.ref, int, torch.Tensor | None]] = []

    def get(self, mask: torch.Tensor | None, batch: int, heads: int, q_len: int, k_len: int) -> torch.Tensor | None:
        """`[n, heads]` int64 positions, or None (not listable: the caller takes the chunked path)."""
        if mask is None or mask.dtype != torch.bool or q_len != k_len or tuple(mask.shape) != (batch, 1, q_len, k_len):
            return None
        if mask.device.type != "cpu":  # listing the pairs (`nonzero`) would wait for the device: a host sync
            return None
        if torch.compiler.is_compiling():
            return None
        for held, h, where in self._entries:
            if held() is mask and h == heads:
                return where
        where = self._list(mask, heads)
        live = [e for e in self._entries if e[0]() is not None]
        self._entries = [(weakref.ref(mask), heads, where), *live[: self._size - 1]]
        return where

    @staticmethod
    def _list(mask: torch.Tensor, heads: int) -> torch.Tensor | None:
        q_len, k_len = mask.shape[-2:]
        # a padding query (one that may not attend to itself) is left out, as on the chunked path
        allowed = mask & mask.diagonal(dim1=-2, dim2=-1)[..., None]
        at = allowed.reshape(-1).nonzero().reshape(-1)  # b * plane + q * k_len + k, in row-major order
        if at.numel() == 0 or at.numel() * heads > _GATHER_LIMIT:
            return None
        plane = q_len * k_len
        # the same position in the [B, H, q, k] logits of head 0: b * heads * plane + q * k_len + k
        flat = at + (at // plane) * ((heads - 1) * plane) if heads > 1 else at
        return flat[:, None] + torch.arange(0, heads * plane, plane, device=mask.device)[None, :]


_ALLOWED = AllowedPairs()


def _gathered_max(query: torch.Tensor, key: torch.Tensor, where: torch.Tensor, scaling: float) -> torch.Tensor:
    """`head_max_logits` for a pattern listed by `AllowedPairs`: one batched matmul for every head's logits, then the
    maximum over the listed positions only (the maximum the chunked path takes after masking the rest with -inf)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    work = query.dtype if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else torch.float32
    # (under `head_max_logits`' no_grad: no detach needed; `.to` only where the dtype changes)
    q3 = (query if query.dtype == work else query.to(work)).reshape(batch * kv_heads, (heads // kv_heads) * q_len, dim)
    k3 = (key if key.dtype == work else key.to(work)).reshape(batch * kv_heads, k_len, dim).transpose(1, 2)
    logits = torch.bmm(q3, k3)  # [B * KV, G * q, k]: the [B, H, q, k] logits, heads of a group consecutive
    return logits.reshape(-1).take(where).float().amax(dim=0) * scaling


class LogitProbe:
    """Collects per-layer max attention logits on the steps a callback arms it for.

    The attention function calls `observe()` only while armed and while the module is in training mode
    (evaluation between steps never pollutes a sample). Several micro-batches of one optimizer step, and
    gradient-checkpointing recomputations, fold into one maximum. Several callbacks (the monitor and
    QK-clip) may arm the same step; the first `arm()` of a step clears the previous sample.

    Example:
        >>> probe = get_probe(); probe.arm(step=10)
        >>> model(**batch).loss.backward()
        >>> probe.disarm(); probe.read()  # {0: [max logit of head 0, ...], 1: [...]}
    """

    def __init__(self, chunk_elements: int = 1 << 26):
        self.chunk_elements = chunk_elements
        self._armed = False
        self._step: int | None = None
        self._maxima: dict[int, torch.Tensor] = {}
        self._auto_index: dict[int, int] = {}
        self._read_cache: dict[int, list[float]] | None = None

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def step(self) -> int | None:
        """The step of the current (or last) sample."""
        return self._step

    def arm(self, step: int) -> None:
        if self._step != step:
            self._maxima = {}
            self._read_cache = None
            self._step = step
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def reset(self) -> None:
        self._armed = False
        self._step = None
        self._maxima = {}
        self._read_cache = None

    def _layer_index(self, module) -> int:
        idx = getattr(module, "layer_idx", None)
        if idx is None:  # attention modules without an index: number them in first-call order
            idx = self._auto_index.setdefault(id(module), len(self._auto_index))
        return int(idx)

    def observe(self, module, query, key, mask, scaling, **pattern) -> None:
        """Fold this call's per-head maxima into the sample (no host sync)."""
        heads = head_max_logits(query, key, mask, scaling, chunk_elements=self.chunk_elements, **pattern)
        idx = self._layer_index(module)
        prev = self._maxima.get(idx)
        self._maxima[idx] = heads if prev is None else torch.maximum(prev, heads)
        # A forward after the sample was read (none in the Trainer's step: reads come after the last backward) does
        # not reopen the read: whether `read` runs a collective must not depend on this rank's forwards.

    def read(self, reduce: bool = True) -> dict[int, list[float]]:
        """`{layer_idx: [max logit per query head]}` of the current sample, one device→host transfer.

        With `reduce` and an initialised process group, the maxima are all-reduced (MAX) first; every rank
        must then call `read()` at the same point, which the Trainer's lock-step callbacks guarantee. The result is
        kept for the rest of the sample (cleared by `arm` of a new step), so a second reader of the step (the
        monitor after QK-clip) gets it without a second collective on any rank.
        """
        if self._read_cache is not None:
            return self._read_cache
        if not self._maxima:
            return {}  # every rank runs the same model and micro-batches: then no rank has observed a layer
        layers = sorted(self._maxima)
        width = max(self._maxima[i].numel() for i in layers)
        rows = [
            torch.nn.functional.pad(self._maxima[i], (0, width - self._maxima[i].numel()), value=float("-inf"))
            for i in layers
        ]
        stacked = torch.stack(rows)
        if reduce:
            from hf_stable.distributed import all_reduce_tensor

            all_reduce_tensor(stacked, "max")
        values = stacked.tolist()
        self._read_cache = {
            i: [v for v in row[: self._maxima[i].numel()]] for i, row in zip(layers, values, strict=False)
        }
        return self._read_cache

    def layer_maxima(self, reduce: bool = True) -> dict[int, float]:
        """`{layer_idx: max over heads}` of the current sample."""
        return {i: max(heads) for i, heads in self.read(reduce).items()}


_PROBE = LogitProbe()


def get_probe() -> LogitProbe:
    """The process-wide probe the `hf_stable` attention function feeds."""
    return _PROBE
