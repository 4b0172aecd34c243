"""`ScreenedForwards`: the screening half of `SpikeForensics` - every training forward's per-sample losses, kept on
device and judged together every `screen_every` steps against the healthy distribution, and the prompt rule's
second look at the suspects (`hf_stable.forensics.screening`) that screening and a bad step's attribution share."""

from __future__ import annotations

import math
import time

import torch

from hf_stable.core.engine import StepEngine
from hf_stable.distributed import all_gather_rows, rank
from hf_stable.forensics.attribution import Culprit, SampleRow, judge, ratios
from hf_stable.forensics.screening import select_suspects, suspect_prompt_gains

SAMPLE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")  # kept per forward for suspects' re-runs


class ScreenedForwards:
    """Mixin of `SpikeForensics` (which provides `cfg`, `records`, `quarantine`, `trajectory`, `_model`, `_tap`,
    `_args`, `_step`, `_buffer`, `_reference`, `_bad_steps`, `screen_seconds`, `_sample_losses` and `_quarantine`)."""

    def _screen_forward(self, kwargs, output, record_ids) -> None:
        logits = getattr(output, "logits", None)
        source = logits.detach() if logits is not None else getattr(output, "chunked", None)  # hf_stable.loss
        labels = kwargs.get("labels")
        if record_ids is None or source is None or not isinstance(labels, torch.Tensor):
            return
        started = time.perf_counter()
        with torch.no_grad():
            loss, count = self._sample_losses(kwargs, source, record_ids)
        kept = {k: v for k, v in kwargs.items() if k in SAMPLE_KEYS and isinstance(v, torch.Tensor)}
        self._buffer.append((self._step, record_ids.to(loss.device), loss, count, kept))
        self.screen_seconds += time.perf_counter() - started  # on an accelerator: launch time only (no sync here)

    def _flush_screen(self, step: int) -> None:
        device = next(self._model.parameters()).device if self._model is not None else torch.device("cpu")
        parts = [
            torch.stack(
                [
                    torch.full_like(loss, s, dtype=torch.float64),
                    ids.double(),
                    loss.double(),
                    count.double(),
                    torch.full_like(loss, float(rank()), dtype=torch.float64),
                ],
                dim=1,
            )
            for s, ids, loss, count, _ in self._buffer
        ]
        located = {
            (s, rid): (inputs, seg)
            for s, ids, _, _, inputs in self._buffer
            for seg, rid in enumerate(ids.tolist())
            if rid >= 0
        }
        self._buffer = []
        local = torch.cat(parts).to(device) if parts else torch.zeros((0, 5), dtype=torch.float64, device=device)
        gathered = all_gather_rows(local)  # every rank, every flush step: rank-agreed
        if not gathered.numel():
            return
        table = [r for r in gathered.tolist() if r[1] >= 0 and r[0] >= 0]
        by_step: dict[int, list[SampleRow]] = {}
        for s, rid, loss, count, rk in table:
            by_step.setdefault(int(s), []).append(SampleRow(int(rid), loss, int(count), math.nan, int(rk)))
        judged = {}
        for s in sorted(by_step):
            if s in self._bad_steps:  # attributed already; not healthy either
                continue
            rows = by_step[s]
            reference = list(self._reference) if len(self._reference) >= self.cfg.min_reference else None
            culprits, _, med = judge(
                rows,
                reference,
                zscore=self.cfg.zscore,
                min_rel=self.cfg.min_rel,
                min_excess=self.cfg.min_excess_nats,
                reason="screen_outlier",
            )
            judged[s] = (rows, culprits, med)
        for s, culprit in self._prompt_mismatches(judged, located):
            judged[s][1].append(culprit)
        for s, (rows, culprits, med) in judged.items():
            culprits = [
                c
                for c in sorted(culprits, key=lambda c: -c.row.z)[: self.cfg.max_culprits]
                if c.row.record_id not in self.quarantine
            ]
            named = {c.row.record_id for c in culprits}
            live = [r for r in rows if r.tokens > 0]
            self._reference.extend(
                x for r, x in zip(live, ratios(live), strict=False) if math.isfinite(x) and r.record_id not in named
            )
            self._quarantine(s, culprits, med, ["screen"])
        self._bad_steps = {b for b in self._bad_steps if b > step}

    def _prompt_mismatches(self, judged: dict, located: dict) -> list[tuple[int, Culprit]]:
        """(step, culprit) for the suspects of `judged` whose prompt makes their answer less likely (see
        `hf_stable.forensics.screening`). Every rank enters: the suspects come from the gathered table."""
        suspects = select_suspects(judged, self.cfg, self.quarantine)
        if not suspects or self._model is None or StepEngine.of(self._model).forward_is_collective:
            return []  # (FSDP2 / ZeRO-3: each suspect is re-run by the rank holding it - unequal forwards)
        empty = getattr(self.records, "empty_prompt", None) or []
        gains = suspect_prompt_gains(self._model, self._tap, suspects, located, empty, self._args)
        if self.trajectory is not None:  # agreed: the suspects and their gains (summed over ranks)
            self.trajectory.note_gains([r.record_id for _, r in suspects], gains)
        return [
            (s, Culprit(r, "prompt_mismatch", prompt_gain=g))
            for (s, r), g in zip(suspects, gains, strict=True)
            if math.isfinite(g) and g >= self.cfg.prompt_gain_min
        ]
