"""Causal-LM cross-entropy over chunks of the hidden states: the ``[tokens, vocab]`` logits are never held.

The loss needs the logits only at the supervised positions (shifted labels != -100). Those rows of the hidden states
are selected (one host sync: the count), and the LM head and the cross-entropy run over `chunk_size` of them at a
time in a custom autograd function: the forward keeps each chunk's inputs, its per-token NLL and log-sum-exp, not its
logits; the backward calls the head again and turns the recomputed logits, in place, into their gradient
(softmax - onehot, the same idea as Liger's fused linear cross-entropy and Cut Cross-Entropy, arXiv 2411.09009). Peak
logits memory is one or two ``chunk_size x vocab`` tensors instead of ``tokens x vocab`` several times over (logits,
log-softmax, their gradients); the cost is one more head matmul over the supervised rows, fewer than the full
path's matmuls over every position.

The head is called as a module, so whatever wraps it takes part: a LoRA on ``lm_head``, peft's ``modules_to_save``
copy, tied embeddings (the head's weight is the embedding's), ZeRO-3's gather on module forward. Where that gather
is a collective (ZeRO-3, FSDP2 with a sharded head), ranks with different supervised counts would call the head a
different number of times and mismatch: `agree_chunks` makes every rank run the largest count (empty chunks).

Same arithmetic as transformers' ``ForCausalLMLoss`` (``loss/loss_utils.py``): labels padded by one -100 and shifted
(or the caller's ``shift_labels``), logits upcast to float32 after the head (and after Gemma's
``final_logit_softcapping``, applied in the head's dtype as the model does), ``sum / num_items_in_batch`` when the
Trainer passes it, else the mean over the supervised tokens. The optional z-loss (PaLM, arXiv 2204.02311) adds
``z_loss * logsumexp(logits)^2`` per supervised token, normalised the same way.

`row_fns` lets a caller read per-token statistics from the same chunks (float32 logits, in the forward only): what the
forensics read from the full logits on the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

RowFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass
class ChunkedLoss:
    """What `chunked_cross_entropy` computed.

    Attributes:
        loss: the scalar loss (with grad), as the model's forward would return it (plus the z-loss when asked).
        rows: flat indices (into ``labels.reshape(-1)``) of the supervised positions, in chunk order.
        nll: per supervised position, its NLL (float32, detached).
        row_stats: per function of `row_fns`, its tensors concatenated over the chunks (one value per entry of
            `rows`), keyed by the function.
    """

    loss: torch.Tensor
    rows: torch.Tensor
    nll: torch.Tensor
    row_stats: dict[RowFn, tuple[torch.Tensor, ...]] = field(default_factory=dict)


def shifted_labels(labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """The label each position predicts: ``labels`` shifted left by one with -100 at every row's end (the model's
    own loss), or `shift_labels` as given (context / sequence parallelism passes them pre-shifted)."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


class _RowStats:
    """The row functions' results for one chunk (computed in the forward, on its logits)."""

    def __init__(self, fns: Sequence[RowFn]):
        self.fns = fns
        self.out: list[tuple[torch.Tensor, ...]] | None = None

    def read(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        if self.fns:
            self.out = [tuple(t.float() for t in fn(logits, target)) for fn in self.fns]


def _capped(raw: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The loss's float32 logits from the head's output: Gemma's soft-cap in the head's dtype (as its forward)."""
    if softcap is not None:
        raw = torch.tanh(raw / softcap) * softcap
    return raw.float()


class _ChunkCrossEntropy(torch.autograd.Function):
    """(NLL, logsumexp) per row of one chunk; the backward calls the head again and writes d loss / d logits into
    the recomputed logits' own storage, so a chunk holds one or two ``[rows, vocab]`` tensors at a time (autograd
    through the head's output alone: a LoRA or trainable head gets its gradient, returned for its parameters)."""

    @staticmethod
    def forward(ctx, hidden, target, head, softcap, stats, *params):
        device = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), device)
        ctx.head, ctx.softcap, ctx.n_params = head, softcap, len(params)
        ctx.set_materialize_grads(False)
        logits = _capped(head(hidden), softcap)
        lse = torch.logsumexp(logits, dim=-1)
        nll = lse - logits.gather(1, target[:, None])[:, 0]
        stats.read(logits, target)
        ctx.save_for_backward(hidden, target, lse, *params)
        return nll, lse

    @staticmethod
    def backward(ctx, g_nll, g_lse):
        hidden, target, lse, *params = ctx.saved_tensors
        enabled, dtype, device = ctx.autocast
        h = hidden.detach().requires_grad_(ctx.needs_input_grad[0])
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            raw = ctx.head(h)
        with torch.no_grad():
            rows = torch.arange(target.numel(), device=target.device)
            g_nll = g_nll if g_nll is not None else torch.zeros_like(lse)
            coef = g_nll + g_lse if g_lse is not None else g_nll
            if ctx.softcap is None:
                # d nll / d logits = softmax - onehot(gold); d lse / d logits = softmax. The float32 logits are the
                # head's output itself when it is float32 (its backward does not read its output)
                grad = raw.detach().float().sub_(lse[:, None]).exp_().mul_(coef[:, None])
                grad[rows, target] -= g_nll
            else:  # through the cap: d cap*tanh(x/cap) / dx = 1 - tanh^2, the tanh taken in the head's dtype
                t = torch.tanh(raw.detach() / ctx.softcap).float()
                grad = (t * ctx.softcap).sub_(lse[:, None]).exp_().mul_(coef[:, None])
                grad[rows, target] -= g_nll
                grad.mul_(t.mul_(t).neg_().add_(1))
                del t
            grad = grad.to(raw.dtype)
        wanted = [
            x
            for x, need in zip([h, *params], ctx.needs_input_grad[:1] + ctx.needs_input_grad[5:], strict=True)
            if need
        ]
        grads = iter(torch.autograd.grad(raw, wanted, grad, allow_unused=True) if wanted else ())
        g_h = next(grads) if ctx.needs_input_grad[0] else None
        g_params = [next(grads) if need else None for need in ctx.needs_input_grad[5:]]
        return (g_h, None, None, None, None, *g_params)


def _chunk_by_autograd(hidden, target, head, softcap, stats):
    """(NLL, logsumexp) of one chunk by plain autograd: run under `torch.utils.checkpoint`, so the backward
    recomputes the chunk by calling the head module again (the row statistics are read in the forward only)."""
    logits = _capped(head(hidden), softcap)
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(1, target[:, None])[:, 0]
    if stats.out is None:
        stats.read(logits.detach(), target)
    return nll, lse


def _chunk(selected, gold, head, softcap, stats, params, checkpointed: bool):
    if not checkpointed:
        return _ChunkCrossEntropy.apply(selected, gold, head, softcap, stats, *params)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_chunk_by_autograd, selected, gold, head, softcap, stats, use_reentrant=False)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_size: int = 1024,
    softcap: float | None = None,
    z_loss: float = 0.0,
    row_fns: Sequence[RowFn] = (),
    agree_chunks: Callable[[int], int] | None = None,
    checkpointed: bool = False,
) -> ChunkedLoss:
    """The causal-LM loss of `hidden` ``[..., T, H]`` through `head`, never holding more than `chunk_size` rows of
    logits.

    Args:
        hidden: the model body's last hidden states.
        head: the LM head module (``model.get_output_embeddings()``, LoRA / peft wrappers included).
        labels: ``[..., T]`` with -100 where not supervised (unshifted, as passed to the model); ignored when
            `shift_labels` is given.
        shift_labels: pre-shifted labels (position t is scored against ``shift_labels[t]``).
        num_items_in_batch: the Trainer's supervised-token count over the accumulated batch: the loss is then
            ``sum / num_items_in_batch``; None: the mean over this batch's supervised tokens (NaN when none).
        chunk_size: supervised rows per chunk.
        softcap: Gemma's ``final_logit_softcapping`` (``cap * tanh(logits / cap)``); None: off.
        z_loss: weight of ``logsumexp(logits)^2`` per supervised token; 0: off.
        row_fns: functions ``fn(logits [n, V] float32 detached, target [n]) -> tuple of [n] tensors`` evaluated on
            every chunk's logits once (see `ChunkedLoss.row_stats`).
        agree_chunks: under an engine whose forward gathers weights (ZeRO-3, FSDP2), every head call is a collective,
            so every rank must make as many; this maps this rank's chunk count to the count all ranks run (the max
            over ranks) and the extra chunks run on zero rows (their forward and backward, no value).
        checkpointed: each chunk runs by plain autograd under `torch.utils.checkpoint` (the backward calls the
            head module again, inside the engine's gather) instead of the autograd function that takes the head's
            trainable parameters as inputs: for a trainable head under ZeRO-3 / FSDP2, whose parameters outside the
            module's forward are empty partitions / sharded DTensors. Its backward holds about three ``chunk x
            vocab`` float32 tensors at a time instead of one.

    Example:
        >>> out = chunked_cross_entropy(body(input_ids).last_hidden_state, model.lm_head, labels)
        >>> out.loss.backward()
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: got {chunk_size}, must be > 0")
    target = shifted_labels(labels, shift_labels).reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = torch.nonzero(target.ne(IGNORE_INDEX)).reshape(-1)  # the one host sync: how many rows to score
    selected, gold = flat.index_select(0, rows), target.index_select(0, rows)
    total = selected.sum() * 0.0  # connected to the graph even without a supervised token (a zero gradient)
    nlls, stats_out = [], []
    params = [p for p in head.parameters() if p.requires_grad]  # a LoRA / trainable head: gradients through apply
    n_chunks = -(-rows.numel() // chunk_size)
    if agree_chunks is not None:
        n_chunks = agree_chunks(n_chunks)
    for start in range(0, n_chunks * chunk_size, chunk_size):  # past the rows: empty chunks
        stats = _RowStats(row_fns)
        part = slice(start, start + chunk_size)
        nll, lse = _chunk(selected[part], gold[part], head, softcap, stats, params, checkpointed)
        total = total + nll.sum()
        if z_loss:
            total = total + z_loss * lse.pow(2).sum()
        nlls.append(nll.detach())
        if row_fns:
            stats_out.append(stats.out)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        loss = total / num_items_in_batch
    else:
        loss = total / rows.numel() if rows.numel() else total / 0.0
    nll = torch.cat(nlls) if nlls else torch.zeros(0, dtype=torch.float32, device=hidden.device)
    return ChunkedLoss(loss, rows, nll, _concat_stats(stats_out, row_fns, hidden.device))


def _concat_stats(per_chunk: list[list[tuple[torch.Tensor, ...]]], fns: Sequence[RowFn], device) -> dict:
    if not per_chunk:  # no supervised row: each function's outputs empty (its arity is unknown without a call)
        return {fn: () for fn in fns}
    return {
        fn: tuple(torch.cat(parts) for parts in zip(*(c[k] for c in per_chunk), strict=True))
        for k, fn in enumerate(fns)
    }
