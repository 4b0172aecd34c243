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
    loss, count, _ = per_sample_nll_stats(logits, labels, position_ids, n_segments)
    return loss, count


def per_sample_nll_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    n_segments: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token-mean NLL, supervised-token count, the largest token NLL) per sample, as `per_sample_loss` (one
    cross-entropy pass). The peak is the one token the model least expected: the first token of an answer that
    belongs to another question, say, where a hard answer of the right kind spreads its loss over many tokens."""
    b, t, v = logits.shape
    seg = segment_index(labels, position_ids).reshape(b, t)[:, 1:].reshape(-1)
    target = labels[:, 1:].reshape(-1)
    mask = target.ne(IGNORE_INDEX)
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), target.clamp_min(0), reduction="none")
    nll = torch.where(mask, nll, torch.zeros_like(nll))
    if n_segments is None:
        n_segments = b if position_ids is None else int(seg.max().item()) + 1 if seg.numel() else 0
    sums = torch.zeros(n_segments, dtype=torch.float32, device=logits.device).index_add_(0, seg, nll)
    counts = torch.zeros(n_segments, dtype=torch.float32, device=logits.device).index_add_(0, seg, mask.float())
    peak = torch.zeros(n_segments, dtype=torch.float32, device=logits.device)
    peak = peak.scatter_reduce(0, seg, nll, reduce="amax", include_self=True)
    return sums / counts, counts, peak


def per_sample_margin(
    logits: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    n_segments: int | None = None,
) -> torch.Tensor:
    """Token-mean margin per sample, ``[n_segments]`` float32: the label's logit minus the largest other logit,
    averaged over the sample's supervised tokens (the margin of Pleiss et al. 2020, arXiv 2001.10528, per token).
    Negative where the model prefers another token; a confidently wrong answer is far below zero, an uncertain one
    near it. Computed in the logits' own dtype (no float copy of ``[B, T, V]``); NaN without a supervised token."""
    b, t, v = logits.shape
    seg = segment_index(labels, position_ids).reshape(b, t)[:, 1:].reshape(-1)
    target = labels[:, 1:].reshape(-1)
    mask = target.ne(IGNORE_INDEX)
    flat = logits[:, :-1].reshape(-1, v)
    top = flat.topk(2, dim=-1)
    gold = flat.gather(1, target.clamp_min(0)[:, None])[:, 0]
    other = torch.where(top.indices[:, 0] == target, top.values[:, 1], top.values[:, 0])
    margin = torch.where(mask, (gold - other).float(), torch.zeros_like(gold, dtype=torch.float32))
    if n_segments is None:
        n_segments = b if position_ids is None else int(seg.max().item()) + 1 if seg.numel() else 0
    sums = torch.zeros(n_segments, dtype=torch.float32, device=logits.device).index_add_(0, seg, margin)
    counts = torch.zeros(n_segments, dtype=torch.float32, device=logits.device).index_add_(0, seg, mask.float())
    return sums / counts
