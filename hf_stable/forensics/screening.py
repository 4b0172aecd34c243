"""Screening's second look at a suspect: does its prompt explain its answer?

A *suspect* is a sample of a screened (or bad) step that stands out - robust z above ``suspect_zscore`` and
``suspect_excess_nats`` above the step's median loss over its tokens - but not enough for the loss rule
(`hf_stable.forensics.attribution.judge`): a short answer of another question looks like a hard question by its
loss alone. The rank holding each suspect re-runs it with its prompt and after an empty prompt
(`attribution.prompt_gain`); the gains are summed over ranks, so every rank reads the same numbers. The suspects
are chosen from the gathered table, so every rank enters the reduce.
"""

from __future__ import annotations

import contextlib
import math

import torch

from hf_stable.distributed import all_reduce_tensor, rank
from hf_stable.forensics import attribution


def select_suspects(judged: dict, cfg, quarantine) -> list[tuple[int, attribution.SampleRow]]:
    """(step, row) of at most ``cfg.max_suspects`` suspects of `judged` (step -> (rows, culprits, step median)),
    highest z first; culprits and quarantined records excluded. Pure: the same table gives the same list."""
    named = {c.row.record_id for _, cs, _ in judged.values() for c in cs}
    picked = sorted(
        (
            (r.z, s, r)
            for s, (rows, _, med) in judged.items()
            for r in rows
            if math.isfinite(r.z)
            and r.z > cfg.suspect_zscore
            and (r.loss - med) * r.tokens >= cfg.suspect_excess_nats
            and r.record_id not in named
            and r.record_id not in quarantine
        ),
        key=lambda t: (-t[0], t[1], t[2].record_id),
    )[: cfg.max_suspects]
    return [(s, r) for _, s, r in picked]


def suspect_prompt_gains(model, tap, suspects, located: dict, empty_prompt: list[int], args=None) -> list[float]:
    """`prompt_gain` of each suspect, computed by the rank holding it (`located`: (step, record id) -> (the
    micro-batch's inputs, segment) on this rank) and summed over ranks (a collective: every rank enters)."""
    device = next(model.parameters()).device
    gains = torch.zeros(len(suspects), dtype=torch.float64, device=device)
    me = rank()
    with tap.replaying() if tap is not None else contextlib.nullcontext():  # recording paused, RNG forked
        for k, (s, r) in enumerate(suspects):
            where = located.get((s, r.record_id)) if r.rank == me else None
            sample = attribution.single_sample_inputs(where[0], where[1]) if where is not None else None
            if sample is None:
                continue
            with contextlib.suppress(Exception):  # evidence only: never fail the run over it
                gains[k] = attribution.prompt_gain(model, sample, empty_prompt, args)
    return all_reduce_tensor(gains, "sum").tolist()
