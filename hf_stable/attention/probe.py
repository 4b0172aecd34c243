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
