"""Per-sample loss of a batch, on device, from the logits the forward already produced.

A sample's loss is the token-mean NLL over its own supervised tokens (labels != -100, shifted by one as the
causal-LM loss is), whatever the batch layout:

* padded batch ``[B, T]``: one sample per row;
* packed batch (``position_ids`` restarting at 0 for every sample, see ``hf_stable/data/collators.py``): the
  rows are flattened in order and every restart opens a new segment, so segment k is the k-th sample of the
  collator's ``record_ids`` (a tail padding segment has no supervised token and gets a NaN loss, count 0).

The label at position t+1 is predicted from position t and belongs to the segment of position t+1; the collator
makes the first label of every packed segment -100, so no token is ever scored across a sample boundary. No host
sync: the segment count comes from the shape of ``record_ids`` (or the row count).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def segment_index(labels: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Segment of every position of ``labels`` ``[B, T]``, flattened row-major: the row (padded), or the count of
    ``position_ids`` restarts so far minus one (packed)."""
    b, t = labels.shape
    if position_ids is None or position_ids.shape != labels.shape:
        return torch.arange(b, device=labels.device).repeat_interleave(t)
    starts = position_ids.reshape(-1).eq(0).to(torch.long)
    return starts.cumsum(0) - 1


def per_sample_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    n_segments: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean NLL, supervised-token count) per sample, both ``[n_segments]`` float32 on the logits' device.

    Args:
        logits: ``[B, T, V]`` from the forward.
        labels: ``[B, T]`` with -100 where not supervised (unshifted, as passed to the model).
        position_ids: packed batches: ``[B, T]`` restarting at 0 per sample; None for padded batches.
        n_segments: samples in the batch (``len(record_ids)``); default: rows (padded) or restarts (one sync).

    A sample without a supervised token gets NaN and count 0; a sample whose logits are non-finite gets a
    non-finite loss (kept: that is the evidence).
    """
    flat, seg, gold, mask, n_segments = _positions(logits, labels, position_ids, n_segments)
    (nll,) = _supervised_rows(flat, mask, lambda f, g: (F.cross_entropy(f.float(), g, reduction="none"),), gold)
    sums = torch.zeros(n_segments, dtype=torch.float32, device=logits.device).index_add_(0, seg, nll)
    counts = torch.zeros(n_segments, dtype=torch.float32, device=logits.device).index_add_(0, seg, mask.float())
    return sums / counts, counts


def _positions(logits, labels, position_ids, n_segments):
    """(logits ``[N, V]`` of the positions that predict a label, their segment, gold token (0 where none),
    supervised mask, segment count) - labels shifted by one as the causal-LM loss is."""
    b, t, v = logits.shape
    seg = segment_index(labels, position_ids).reshape(b, t)[:, 1:].reshape(-1)
    target = labels[:, 1:].reshape(-1)
    if n_segments is None:
        n_segments = b if position_ids is None else int(seg.max().item()) + 1 if seg.numel() else 0
    return logits[:, :-1].reshape(-1, v), seg, target.clamp_min(0), target.ne(IGNORE_INDEX), n_segments


def _supervised_rows(flat, supervised, fn, gold):
    """`fn(rows of flat, their gold)` -> float32 ``[rows]`` tensors, scattered back to every position (0 where not
    supervised). On CPU only the supervised rows are computed (no device to sync with); on an accelerator all of
    them (selecting would sync)."""
    if flat.device.type != "cpu":
        return tuple(torch.where(supervised, x, torch.zeros_like(x)) for x in fn(flat, gold))
    rows = torch.nonzero(supervised).reshape(-1)
    zeros = torch.zeros(flat.shape[0], dtype=torch.float32)
    return tuple(zeros.index_copy(0, rows, x.float()) for x in fn(flat[rows], gold[rows]))


def per_sample_answer_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    n_segments: int | None = None,
    prefixes: torch.Tensor | None = None,
    text: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, count, answer nats, first-token NLL, token-mean margin) per sample, ``[n_segments]`` float32 each, on
    device (no sync): `per_sample_loss`'s two and the three the trajectory rule reads
    (`hf_stable.forensics.trajectory`), from one log-sum-exp over the logits.

    Every position is scored by the probability of the next tokens that agree with the answer's text: the gold
    token or one of its `prefixes` (``[V, K]`` from `hf_stable.forensics.token_prefixes.prefix_table`; None: the
    gold token alone, the plain NLL). *Answer nats* is the sum over the sample's supervised tokens, *first-token
    NLL* the first supervised token's (where an answer of another question shows its kind), the *margin* that
    log-probability minus the best disagreeing token's among the top 3 (Pleiss et al. 2020, arXiv 2001.10528, per
    token; far below zero: confidently another answer; when all three agree, the third stands for it: a lower
    bound). `text` (``[V]`` bool, `token_prefixes.text_mask`): only the supervised tokens that are text count for
    those three - the end-of-turn / EOS token is left out. NaN for a sample without one."""
    flat, seg, gold, supervised, n_segments = _positions(logits, labels, position_ids, n_segments)
    rows = _supervised_rows(flat, supervised, lambda f, g: _agreeing_mass(f, g, prefixes), gold)
    return _answer_stats(seg, gold, supervised, rows, n_segments, text)


def _answer_stats(seg, gold, supervised, rows, n_segments: int, text):
    """`per_sample_answer_stats` from every position's (plain NLL, log-agreeing mass, best disagreeing) values."""
    plain, log_agree, disagree = rows
    device = plain.device
    mask = supervised & text[gold] if text is not None else supervised
    margin = torch.where(mask, log_agree - disagree, torch.zeros_like(plain))
    nll = torch.where(mask, -log_agree, torch.zeros_like(plain))
    zeros = torch.zeros(n_segments, dtype=torch.float32, device=device)
    count = zeros.index_add(0, seg, supervised.float())
    loss = zeros.index_add(0, seg, plain) / count
    text_count = zeros.index_add(0, seg, mask.float())
    nats = zeros.index_add(0, seg, nll)
    margins = zeros.index_add(0, seg, margin) / text_count
    where = torch.arange(seg.numel(), device=device)
    where = torch.where(mask, where, torch.full_like(where, seg.numel()))
    first = torch.full((n_segments,), seg.numel(), dtype=where.dtype, device=device)
    first = first.scatter_reduce(0, seg, where, reduce="amin", include_self=True)
    padded = torch.cat([nll, torch.full((1,), math.nan, device=device)])
    nats = torch.where(text_count > 0, nats, torch.full_like(nats, math.nan))
    return loss, count, nats, padded[first], margins


def _agreeing_mass(flat: torch.Tensor, gold: torch.Tensor, prefixes: torch.Tensor | None):
    """Per row of `flat` ``[N, V]``: (gold NLL, log-probability of the tokens agreeing with gold - gold and its
    `prefixes` -, log-probability of the best disagreeing token among the top 3)."""
    lse = torch.logsumexp(flat.float(), dim=-1)
    agree = torch.cat([gold[:, None], prefixes[gold]], dim=1) if prefixes is not None else gold[:, None]
    agree_logits = flat.gather(1, agree.clamp_min(0)).float().masked_fill(agree.lt(0), -math.inf)
    top = flat.topk(min(3, flat.shape[-1]), dim=-1)
    agreeing = (top.indices[:, :, None] == agree[:, None, :]).any(-1)
    agreeing[:, -1] = False  # all three agree: the third stands for the best disagreeing token
    disagree = top.values.float().masked_fill(agreeing, -math.inf).max(-1).values
    return lse - agree_logits[:, 0], torch.logsumexp(agree_logits, dim=-1) - lse, disagree - lse


# --- the same statistics from the chunked training loss (hf_stable.loss), which never builds the whole logits ------


def _chunk_positions(chunked, labels, position_ids, n_segments):
    """(segment, gold, supervised mask, position index of every chunk row, n_segments) in `_positions`' layout: the
    chunks' rows index the ``[B, T]`` positions, row t of sample b predicting label t + 1 (never the last column)."""
    b, t = labels.shape
    seg = segment_index(labels, position_ids).reshape(b, t)[:, 1:].reshape(-1)
    target = labels[:, 1:].reshape(-1)
    if n_segments is None:
        n_segments = b if position_ids is None else int(seg.max().item()) + 1 if seg.numel() else 0
    at = chunked.rows // t * (t - 1) + chunked.rows % t
    return seg, target.clamp_min(0), target.ne(IGNORE_INDEX), at, n_segments


def _scatter(at: torch.Tensor, n: int, values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(n, dtype=torch.float32, device=at.device).index_copy(0, at, v.float()) for v in values)


def chunk_sample_loss(chunked, labels, position_ids=None, n_segments=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`per_sample_loss` from a `hf_stable.loss.ChunkedLoss` (its per-token NLL) instead of the logits."""
    seg, _, supervised, at, n_segments = _chunk_positions(chunked, labels, position_ids, n_segments)
    (nll,) = _scatter(at, seg.numel(), (chunked.nll,))
    sums = torch.zeros(n_segments, dtype=torch.float32, device=nll.device).index_add_(0, seg, nll)
    counts = torch.zeros(n_segments, dtype=torch.float32, device=nll.device).index_add_(0, seg, supervised.float())
    return sums / counts, counts


def answer_row_fn(prefixes_of):
    """A `hf_stable.loss` row function computing `per_sample_answer_stats`' per-token values on each chunk's logits;
    `prefixes_of(vocab, device)` gives the prefix table for the logits' vocabulary (or None)."""

    def answer_rows(logits: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _agreeing_mass(logits, gold, prefixes_of(logits.shape[-1], logits.device))

    return answer_rows


def chunk_answer_stats(chunked, row_fn, labels, position_ids=None, n_segments=None, text=None):
    """`per_sample_answer_stats` from a `ChunkedLoss` whose chunks ran `row_fn` (an `answer_row_fn`)."""
    seg, gold, supervised, at, n_segments = _chunk_positions(chunked, labels, position_ids, n_segments)
    values = chunked.row_stats.get(row_fn) or (chunked.nll,) * 3  # () / absent: no supervised row in the batch
    rows = _scatter(at, seg.numel(), values)
    return _answer_stats(seg, gold, supervised, rows, n_segments, text)
