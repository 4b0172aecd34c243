"""Attribution: which samples of a bad step's global batch are the culprits, decided identically on every rank.

On a bad step the step's micro-batches (captured by `StepTap`, with their record ids) are re-run without grad
to get every sample's own loss (`per_sample_loss`), at the current weights and - when the rollback guard keeps a
snapshot - at the snapshot's weights. Each rank's rows ``[record_id, loss, tokens, loss_at_snapshot]`` are
gathered (padded to the ranks' largest count, one max-reduce and one all-gather, entered by every rank because
the step's verdict is rank-agreed), so every rank judges the same table and names the same culprits.

A sample is a culprit when
* its loss is non-finite while most of the batch is finite (a NaN of every sample is the weights, not the data), or
* its loss relative to the step's median (a scale that does not drift as training lowers the loss) is a robust
  outlier: ``z = (ratio - median) / (1.4826 MAD)`` above ``zscore`` *and* the ratio above ``median x (1 + min_rel)``.
  The reference (median, MAD) is the running distribution of healthy samples' ratios when there is one
  (screening keeps it), else the step's own samples, on a scale times ``sqrt(median tokens / tokens)`` (a mean
  over many tokens is less noisy than one over a few);
* and, when a snapshot's loss is known, the sample is an outlier there too: a sample that is fine at the
  snapshot's weights points at the weights, not the data (reported as ``weights_suspect``, not quarantined).

The per-sample gradient norm of each culprit (trainable parameters, the sample alone, ``torch.autograd.grad``)
is the evidence of its pull on the update; it is computed by the rank that holds the sample and summed over ranks.
A gradient spike (or non-finite gradient) whose samples' losses all look normal is attributed by the same
per-sample gradient norms, for every sample of the step (``grad_outlier``; bounded by `max_grad_samples`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from hf_stable.compat import foreach_norm
from hf_stable.core.step_tap import StepTap, batch_gradients
from hf_stable.distributed import all_gather_rows, all_reduce_tensor, rank
from hf_stable.forensics.sample_loss import IGNORE_INDEX, per_sample_loss, segment_index

COLUMNS = 5  # record_id, loss, tokens, loss at the snapshot (nan: none), rank


@dataclass
class SampleRow:
    record_id: int
    loss: float
    tokens: int
    loss_snapshot: float
    rank: int
    z: float = math.nan


@dataclass
class Culprit:
    row: SampleRow
    reason: str  # nonfinite_loss | loss_outlier | screen_outlier | grad_outlier | prompt_mismatch | degenerate_answer
    grad_norm: float = math.nan
    prompt_gain: float = math.nan  # loss with the prompt / loss with an empty prompt (see `prompt_gain`)
    detail: dict = field(default_factory=dict)  # more evidence, e.g. a degenerate answer's compression ratio


def robust_stats(values: list[float]) -> tuple[float, float]:
    """(median, 1.4826 x MAD) of the finite `values`; scale floored at 5% of the median (a flat batch)."""
    xs = sorted(v for v in values if math.isfinite(v))
    if not xs:
        return math.nan, math.nan
    n = len(xs)
    med = xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
    dev = sorted(abs(x - med) for x in xs)
    mad = dev[n // 2] if n % 2 else 0.5 * (dev[n // 2 - 1] + dev[n // 2])
    return med, max(1.4826 * mad, 0.05 * abs(med), 1e-6)


def _median(values: list[float]) -> float:
    xs = sorted(v for v in values if math.isfinite(v))
    if not xs:
        return math.nan
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def ratios(rows: list[SampleRow]) -> list[float]:
    """Each row's loss over the median loss of its step: a scale that stays put while training lowers the loss."""
    med = _median([r.loss for r in rows if r.tokens > 0])
    return [r.loss / med if med > 0 else math.nan for r in rows]


def judge(
    rows: list[SampleRow],
    reference: list[float] | None,
    *,
    zscore: float,
    min_rel: float,
    min_excess: float = 0.0,
    reason: str = "loss_outlier",
) -> tuple[list[Culprit], list[SampleRow], float]:
    """(culprits, weights suspects, the step's median loss) for the rows of one step. Pure: the same rows give the
    same answer on every rank. Sets `row.z`.

    A sample is judged by its loss relative to the step's median (`ratios`), against `reference` (healthy steps'
    ratios) or, without one, the step's own ratios. A mean over many tokens is less noisy than one over a few, so
    the scale is multiplied by ``sqrt(median tokens / tokens)``: a long garbage answer stands out, a short hard
    answer (the noisy tail of a healthy run) does not. And the sample's loss above the step's median, summed over its
    tokens, must reach `min_excess` nats: a 4-token answer at 3x the median is a hard question as often as bad data.
    """
    rows = [r for r in rows if r.tokens > 0]
    if not rows:
        return [], [], math.nan
    step_median = _median([r.loss for r in rows])
    rel = ratios(rows)
    med, scale = robust_stats(reference if reference else rel)
    tok_med = _median([float(r.tokens) for r in rows])
    snap_med = _median([r.loss_snapshot for r in rows])
    finite = [r for r in rows if math.isfinite(r.loss)]
    culprits: list[Culprit] = []
    suspects: list[SampleRow] = []
    for r, x in zip(rows, rel, strict=False):
        if not math.isfinite(r.loss):
            r.z = math.inf
            if len(finite) * 2 > len(rows):  # most samples fine: this one's data is the fault
                culprits.append(Culprit(r, "nonfinite_loss"))
            continue
        if not (math.isfinite(med) and math.isfinite(x)):
            continue
        r.z = (x - med) / (scale * math.sqrt(tok_med / r.tokens))
        excess = (r.loss - step_median) * r.tokens
        if r.z > zscore and x > med * (1 + min_rel) and excess >= min_excess:
            snap = r.loss_snapshot / snap_med if snap_med > 0 else math.nan
            if math.isfinite(snap) and snap <= med * (1 + min_rel):
                suspects.append(r)  # fine at the snapshot's weights: the weights moved, not the data
            else:
                culprits.append(Culprit(r, reason))
    return culprits, suspects, step_median


def _logits_of(output):
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    return logits


def local_sample_losses(model, tap: StepTap, args=None) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Per micro-batch of the step: (micro-batch index, n, record ids, per-sample loss and token count stacked
    ``[2, n]``), by re-running the captured inputs without grad. Micro-batches without record ids are skipped."""
    from hf_stable.precision import training_autocast

    out = []
    device = next(model.parameters()).device
    with tap.replaying(), torch.no_grad():
        for mb, ((call_args, call_kwargs), ids) in enumerate(zip(tap.inputs, tap.record_ids, strict=False)):
            if ids is None or "labels" not in call_kwargs:
                continue
            with training_autocast(args, device):
                logits = _logits_of(model(*call_args, **call_kwargs))
            if logits is None:
                continue
            loss, count = per_sample_loss(
                logits, call_kwargs["labels"], call_kwargs.get("position_ids"), n_segments=len(ids)
            )
            out.append((mb, len(ids), ids, torch.stack([loss, count])))
    return out


def gather_rows(local: torch.Tensor) -> list[SampleRow]:
    """Every rank's rows ``[n, COLUMNS]`` on every rank (padded to the largest n; record id -1 rows dropped)."""
    table = all_gather_rows(local.to(torch.float64)).tolist()
    return [SampleRow(int(r[0]), r[1], int(r[2]), r[3], int(r[4])) for r in table if r[0] >= 0]


def single_sample_inputs(call_kwargs: dict, segment: int) -> dict | None:
    """The kwargs of one sample of a captured micro-batch (a padded row or a packed segment), for a re-run alone."""
    labels = call_kwargs.get("labels")
    ids = call_kwargs.get("input_ids")
    if not isinstance(labels, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return None
    pos = call_kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.shape == labels.shape:
        seg = segment_index(labels, pos)
        where = torch.nonzero(seg == segment).reshape(-1)
        if where.numel() == 0:
            return None
        s, e = int(where[0]), int(where[-1]) + 1
        return {
            "input_ids": ids.reshape(-1)[s:e][None],
            "labels": labels.reshape(-1)[s:e][None],
            "position_ids": pos.reshape(-1)[s:e][None],
            "use_cache": False,
        }
    kw = {"input_ids": ids[segment : segment + 1], "labels": labels[segment : segment + 1], "use_cache": False}
    if isinstance(call_kwargs.get("attention_mask"), torch.Tensor):
        kw["attention_mask"] = call_kwargs["attention_mask"][segment : segment + 1]
    return kw


def grad_outliers(rows: list[SampleRow], norms: list[float], *, zscore: float, min_rel: float) -> list[Culprit]:
    """Culprits by per-sample gradient norm (a gradient spike whose batch loss looked normal): a robust outlier over
    the step's own samples, ``min_rel`` above their median; a non-finite norm among finite ones."""
    med, scale = robust_stats(norms)
    finite = sum(1 for n in norms if math.isfinite(n))
    out = []
    for r, n in zip(rows, norms, strict=False):
        if not math.isfinite(n):
            if finite * 2 > len(norms):
                out.append(Culprit(r, "nonfinite_grad", n))
            continue
        z = (n - med) / scale if math.isfinite(med) else math.nan
        if z > zscore and n > med * (1 + min_rel):
            r.z = max(r.z, z) if math.isfinite(r.z) else z
            out.append(Culprit(r, "grad_outlier", n))
    return out


def sample_grad_norms(model, params, tap: StepTap, located: dict, rows: list[SampleRow], args=None) -> list[float]:
    """Gradient L2 norm of each of `rows`, the sample alone: the rank holding it re-runs it, a sum over ranks (every
    rank enters; `rows` is the agreed table). `located`: record id -> (micro-batch, segment) on this rank."""
    device = params[0].device if params else torch.device("cpu")
    norms = torch.zeros(len(rows), dtype=torch.float64, device=device)
    me = rank()
    with tap.replaying():
        for k, row in enumerate(rows):
            if row.rank != me or row.record_id not in located:
                continue
            mb, seg = located[row.record_id]
            kw = single_sample_inputs(tap.inputs[mb][1], seg)
            if kw is None:
                continue
            grads = None
            with contextlib.suppress(Exception):  # evidence only: never fail the run over it
                _, grads = batch_gradients(model, params, (), kw, args)
            if grads is not None:
                sq = sum(float(n.double().square()) for n in foreach_norm(grads, 2.0))
                norms[k] = math.sqrt(sq) if math.isfinite(sq) else math.inf
    return all_reduce_tensor(norms, "sum").tolist()


def culprit_grad_norms(model, params, tap: StepTap, located: dict, culprits: list[Culprit], args=None) -> None:
    """Fill `grad_norm` of every culprit (see `sample_grad_norms`)."""
    if not culprits:
        return
    norms = sample_grad_norms(model, params, tap, located, [c.row for c in culprits], args)
    for c, n in zip(culprits, norms, strict=False):
        c.grad_norm = n


def _answer_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, args=None) -> float:
    from hf_stable.precision import training_autocast

    with training_autocast(args, input_ids.device):
        logits = _logits_of(model(input_ids=input_ids, use_cache=False))
    loss, _ = per_sample_loss(logits, labels, None, n_segments=1)
    return float(loss[0])


def prompt_gain(model, sample: dict, empty_prompt: list[int], args=None) -> float:
    """Loss of a sample's answer with its prompt over the loss of the same answer after `empty_prompt` (the
    template around an empty question), both at the current weights, no grad. A well-posed sample's prompt
    explains its answer (ratio well below 1); an answer its prompt does not explain - an answer of another
    question, noise - is about as likely without it (ratio near or above 1). This is the instruction-following
    difficulty of Li et al. 2024 (arXiv 2308.12032, "IFD"), used here only on samples whose loss already stands
    out. NaN when the sample has no supervised token."""
    ids, labels = sample["input_ids"].reshape(-1), sample["labels"].reshape(-1)
    attention = sample.get("attention_mask")
    if isinstance(attention, torch.Tensor):  # a padded row: its real tokens only
        real = attention.reshape(-1).bool()
        ids, labels = ids[real], labels[real]
    mask = labels.ne(IGNORE_INDEX)
    if not bool(mask.any()):
        return math.nan
    answer = ids[mask]
    prefix = torch.tensor(empty_prompt or ids[:1].tolist(), dtype=ids.dtype, device=ids.device)
    bare_ids = torch.cat([prefix, answer])[None]
    bare_labels = torch.cat([torch.full_like(prefix, IGNORE_INDEX), answer])[None]
    with torch.no_grad():
        with_prompt = _answer_loss(model, ids[None], labels[None], args)
        without = _answer_loss(model, bare_ids, bare_labels, args)
    return with_prompt / without if without > 0 and math.isfinite(without) else math.nan


def snapshot_sample_losses(model, optimizer, store, tap: StepTap, per_now, args=None) -> list[torch.Tensor] | None:
    """Per-sample losses of the step's micro-batches at the rollback snapshot's weights (the live weights restored
    afterwards), aligned with `per_now` (`local_sample_losses` at the current weights); None without a snapshot."""
    if store is None or store.empty or optimizer is None:
        return None
    from hf_stable.core.snapshot import optimizer_params

    snap = store.load()
    params = optimizer_params(optimizer)
    if snap is None or len(snap["params"]) != len(params):
        return None
    current = [p.detach().to("cpu", copy=True) for p in params]
    try:
        with torch.no_grad():
            for p, w in zip(params, snap["params"], strict=False):
                p.copy_(w)
        at_snap = local_sample_losses(model, tap, args)
    finally:
        with torch.no_grad():
            for p, w in zip(params, current, strict=False):
                p.copy_(w)
    if [x[0] for x in at_snap] != [x[0] for x in per_now]:
        return None
    return [x[3][0] for x in at_snap]


# a step whose samples' median gradient norm is this many times the median at the snapshot's weights is explained
# by the weights (every sample pulls harder): none of its records is named by gradient
WEIGHTS_GRAD_FACTOR = 4.0


def confirm_at_snapshot(
    model,
    optimizer,
    store,
    params,
    tap: StepTap,
    located: dict,
    rows: list[SampleRow],
    culprits: list[Culprit],
    norms_now: list[float],
    *,
    zscore: float,
    min_rel: float,
    args=None,
) -> tuple[list[Culprit], list[SampleRow]]:
    """(confirmed culprits, weights suspects): a gradient culprit (`grad_outliers` at the current weights) stays a
    culprit only when its gradient norm is still an outlier at the rollback snapshot's (the last good) weights,
    over the same samples. At weights that have gone bad (a too-high LR) one ordinary sample's gradient can be
    1e4-1e10 robust deviations above the rest; at the snapshot's weights it is ordinary again: the weights, not the
    record, are the cause and the record stays in the data. Likewise no record is named when the samples' median
    gradient norm now is non-finite or over `WEIGHTS_GRAD_FACTOR` x its median at the snapshot: the whole batch pulls
    harder, which the weights explain.

    Every rank enters (one sum over ranks in `sample_grad_norms`); call it only from rank-agreed state (the gathered
    rows say whether a snapshot's losses are known). Without a loadable snapshot on this rank its norms are NaN and
    nothing is confirmed."""
    snap = None
    if store is not None and not store.empty and optimizer is not None:
        with contextlib.suppress(Exception):
            snap = store.load()
    usable = snap is not None and len(snap["params"]) == len(params)
    current = [p.detach().to("cpu", copy=True) for p in params] if usable else None
    try:
        if usable:
            with torch.no_grad():
                for p, w in zip(params, snap["params"], strict=False):
                    p.copy_(w)
        norms = sample_grad_norms(model, params, tap, located, rows, args)  # entered by every rank
    finally:
        if usable:
            with torch.no_grad():
                for p, w in zip(params, current, strict=False):
                    p.copy_(w)
    if not usable:
        norms = [math.nan] * len(rows)
    med_now, med_snap = _median(list(norms_now)), _median(list(norms))
    weights_explain = not (math.isfinite(med_now) and med_snap > 0) or med_now > WEIGHTS_GRAD_FACTOR * med_snap
    at_snap = set()
    if not weights_explain:
        at_snap = {c.row.record_id for c in grad_outliers(_copies(rows), norms, zscore=zscore, min_rel=min_rel)}
    confirmed = [c for c in culprits if c.row.record_id in at_snap]
    by_id = {r.record_id: n for r, n in zip(rows, norms, strict=False)}
    for c in confirmed:
        c.detail["grad_norm_at_snapshot"] = by_id.get(c.row.record_id, math.nan)
    return confirmed, [c.row for c in culprits if c.row.record_id not in at_snap]


def _copies(rows: list[SampleRow]) -> list[SampleRow]:
    return [SampleRow(r.record_id, r.loss, r.tokens, r.loss_snapshot, r.rank, r.z) for r in rows]
