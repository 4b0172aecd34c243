"""Trajectory evidence: every record's answer by sighting, kept for the run, judged at the end of each epoch.

A step-local rule sees one loss per record and cannot tell a hard question from a wrong answer: both sit in the
loss distribution's tail at the step they are seen. Two things part them. Across sightings, a wrong answer stays
out at every one of them where a hard record's excess comes and goes with the steps it lands in. And a wrong answer
is wrong in kind (the first token is of another question's answer, another token is preferred by far), where the
clean records that fill a loss rule's tail are mostly charged for how the tokenizer split a right answer - ``2400``
as ``24|00`` when the model predicts ``2`` - which is why every position is scored by the mass of next tokens
that *agree with the answer's text* (the gold token or a token spelling a prefix of it,
`hf_stable.forensics.token_prefixes`; Cao & Rimell 2021, arXiv 2109.02550).

The table (`TrajectoryTable`) keeps, for each record id and each of its last `max_sightings` sightings, from the
training forward's own logits (`sample_loss.per_sample_answer_stats`, on device, no re-run): the answer's nats
(summed over its tokens), its first token's NLL, its token-mean margin and its plain loss (evidence), each next to
the median over the samples of its optimizer step (all ranks' micro-batches: a scale that moves with training),
and the largest prompt gain screening measured for the record when it was a suspect (`screening`). The rows are
gathered over ranks with the screening's decisions (every `screen_every` steps and before a checkpoint), so the
table is identical on every rank, and it is saved in the callback state (float32 bytes, base64): a resume continues
it bit for bit. Memory: 160 bytes a record on the host.

The rule (`judge`), at the end of each epoch, for every record seen at least `min_sightings` times: at its first
and at its latest kept sighting, three features as robust z-scores over the records judged (median, 1.4826 MAD):

* **answer nats** over the step's median: the *confidence* axis of training-dynamics data maps (Swayamdipta et al.
  2020, arXiv 2009.10795: the records a model stays unsure of across epochs are the mislabeled ones) and the
  large-loss side of small-loss selection (co-teaching, Han et al. 2018, arXiv 1804.06872);
* **first-token NLL** over the step's median: the kind of answer - a number where a word was asked for;
* **margin** below the step's median: the area under the margin (Pleiss et al. 2020, arXiv 2001.10528), which
  tells a confidently wrong answer from an uncertain one of the same loss;

averaged over the three and the two sightings, plus ``gain_weight x ln(prompt gain)`` when screening measured a
gain above 1. A score above `zscore` names the record; a record seen only once so far (the end of its first epoch:
its first and latest sighting are the same) is named above the higher `early_zscore`, so the plainest wrong answers
leave the run an epoch sooner and the model learns fewer of them. Both bars are calibrated on clean runs only
(above every clean record's score; see benchmarks/README.md, "forensics"). A base that cannot do a task cannot tell
a wrong answer of it from a right one: its clean records of that task fill the tail, and the bar above them leaves
the mislabeled records that look no worse unnamed.
"""

from __future__ import annotations

import base64
import logging
import math
from dataclasses import dataclass, field

import torch

from hf_stable.distributed import all_gather_rows

logger = logging.getLogger(__name__)

# per-sighting channels of the table: each value and its step's median
NATS, STEP_NATS, FIRST, STEP_FIRST, MARGIN, STEP_MARGIN, LOSS, STEP_LOSS, STEP = range(9)
CHANNELS = 9
ROW = 7  # gathered row: step, record id, loss, tokens, answer nats, first-token NLL, margin
VALUES = (2, 4, 5, 6)  # the row's columns kept with their step medians: loss, nats, first, margin


@dataclass
class TrajectoryVerdict:
    """A record named by its trajectory, with the evidence."""

    record_id: int
    score: float
    evidence: dict = field(default_factory=dict)


def _robust(x: torch.Tensor) -> tuple[float, float]:
    """(median, 1.4826 x MAD) of a 1-d float tensor of finite values; the scale floored at 1e-6."""
    if x.numel() == 0:
        return math.nan, math.nan
    med = float(x.median())
    mad = float((x - med).abs().median())
    return med, max(1.4826 * mad, 1e-6)


def _median(x: torch.Tensor) -> float:
    """The median of a 1-d tensor (mean of the two middle values for an even count: no dependence on ties)."""
    xs = x.sort().values
    n = xs.numel()
    return float(xs[n // 2]) if n % 2 else float(0.5 * (xs[n // 2 - 1] + xs[n // 2]))


class TrajectoryTable:
    """Per-record history of answer nats, first-token NLL, margin and loss by sighting, bounded:
    ``records x max_sightings``.

    Args:
        n_records: records of the run (record ids ``0..n-1``); grows up to `max_records` if a larger id is seen.
        max_sightings: sightings kept per record (the latest ones).
        max_records: record ids at or above this are not tracked (the table's memory bound).

    Example:
        >>> table = TrajectoryTable(2000)
        >>> table.observe(step, record_ids, loss, tokens, nats, first, margin)  # every training forward, on device
        >>> table.flush()                                                 # every rank, at the same steps
        >>> named = table.judge(min_sightings=2, zscore=3.25, gain_weight=8.0)
    """

    def __init__(self, n_records: int = 0, max_sightings: int = 4, max_records: int = 1_000_000):
        self.max_sightings = int(max_sightings)
        self.max_records = int(max_records)
        n = min(int(n_records), self.max_records)
        self.hist = torch.full((n, self.max_sightings, CHANNELS), math.nan, dtype=torch.float32)
        self.seen = torch.zeros(n, dtype=torch.int32)
        self.tokens = torch.zeros(n, dtype=torch.float32)
        self.gains = torch.full((n, 2), math.nan, dtype=torch.float32)  # screening's prompt gains: max, latest
        self._buffer: list[tuple] = []
        self._state: dict | None = None

    def __len__(self) -> int:
        return int(self.hist.shape[0])

    # --- collecting ----------------------------------------------------------------------------------------
    def observe(self, step: int, record_ids, loss, tokens, nats, first, margin) -> None:
        """Keep one forward's per-sample values (device tensors, no sync) until the next `flush`."""
        self._buffer.append((step, record_ids, loss, tokens, nats, first, margin))

    def flush(self, device=None) -> None:
        """Gather every rank's buffered rows (every rank calls this at the same steps) and add them."""
        parts = [
            torch.stack(
                [torch.full_like(loss, float(s), dtype=torch.float64), ids.to(loss.device).double()]
                + [x.double() for x in (loss, *values)],
                dim=1,
            )
            for s, ids, loss, *values in self._buffer
        ]
        self._buffer = []
        if device is None:
            device = parts[0].device if parts else torch.device("cpu")
        local = torch.cat(parts).to(device) if parts else torch.zeros((0, ROW), dtype=torch.float64, device=device)
        rows = all_gather_rows(local)  # rank-agreed: every rank flushes at the same steps
        if rows.numel():
            self.add(rows.cpu())

    def _grow(self, n: int) -> None:
        old = len(self)
        if n <= old:
            return
        pad = torch.full((n - old, self.max_sightings, CHANNELS), math.nan, dtype=torch.float32)
        self.hist = torch.cat([self.hist, pad])
        self.seen = torch.cat([self.seen, torch.zeros(n - old, dtype=torch.int32)])
        self.tokens = torch.cat([self.tokens, torch.zeros(n - old, dtype=torch.float32)])
        self.gains = torch.cat([self.gains, torch.full((n - old, 2), math.nan, dtype=torch.float32)])

    def note_gains(self, record_ids: list[int], gains: list[float]) -> None:
        """The prompt gains screening measured for its suspects (`screening.suspect_prompt_gains`, summed over
        ranks: the same on every rank): kept per record (the largest and the latest) as evidence."""
        for rid, g in zip(record_ids, gains, strict=True):
            if 0 <= rid < self.max_records and math.isfinite(g) and g > 0:
                self._grow(rid + 1)
                old = float(self.gains[rid, 0])
                self.gains[rid, 0] = g if math.isnan(old) else max(old, g)
                self.gains[rid, 1] = g
        self._state = None

    def add(self, rows: torch.Tensor) -> None:
        """Add gathered rows ``[m, 7]`` (step, record id, loss, tokens, nats, first, margin; id < 0: padding).
        Each row's values are kept next to the medians over the rows of its step. Pure in `rows`."""
        rows = rows[(rows[:, 1] >= 0) & (rows[:, 0] >= 0) & (rows[:, 3] > 0)]
        rows = rows[torch.isfinite(rows[:, 2:]).all(1)]
        rows = rows[rows[:, 1] < self.max_records]
        if rows.numel() == 0:
            return
        rows = rows[torch.sort(rows[:, 0], stable=True).indices]
        self._grow(int(rows[:, 1].max()) + 1)
        steps = rows[:, 0]
        medians = torch.zeros((rows.shape[0], len(VALUES)), dtype=torch.float64)
        for s in torch.unique(steps).tolist():
            at = steps == s
            medians[at] = torch.tensor([_median(rows[at, c]) for c in VALUES], dtype=torch.float64)
        loss, nats, first, margin = (rows[:, c] for c in VALUES)
        values = torch.stack(
            [nats, medians[:, 1], first, medians[:, 2], margin, medians[:, 3], loss, medians[:, 0], steps], dim=1
        ).float()
        rid = rows[:, 1].long()
        if torch.unique(rid).numel() == rid.numel() and bool((self.seen[rid] < self.max_sightings).all()):
            self.hist[rid, self.seen[rid].long()] = values  # the common case: each record once, room left
            self.seen[rid] += 1
            self.tokens[rid] = rows[:, 3].float()
        else:
            for k, r in enumerate(rid.tolist()):  # in step order: a record seen twice here, or a full history
                j = int(self.seen[r])
                if j >= self.max_sightings:  # keep the latest sightings
                    self.hist[r, :-1] = self.hist[r, 1:].clone()
                    j = self.max_sightings - 1
                self.hist[r, j] = values[k]
                self.seen[r] += 1
                self.tokens[r] = float(rows[k, 3])
        self._state = None

    # --- the rule ------------------------------------------------------------------------------------------
    def features(self, min_sightings: int = 2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(record ids, {feature: value per record}) of the records seen at least `min_sightings` times: each
        feature at the first (``@first``) and at the latest (``@latest``) kept sighting, against its step's median
        (see the module docstring)."""
        kept = self.seen.clamp(max=self.max_sightings)
        ids = torch.nonzero(kept >= max(min_sightings, 1)).reshape(-1)
        h = self.hist[ids].double()
        last = (kept[ids] - 1).clamp(min=0, max=self.max_sightings - 1).long()
        out = {}
        for slot, at in (("first", torch.zeros_like(last)), ("latest", last)):
            x = h.gather(1, at[:, None, None].expand(-1, 1, CHANNELS))[:, 0]
            out[f"answer_nats@{slot}"] = x[:, NATS] - x[:, STEP_NATS]
            out[f"first_token@{slot}"] = x[:, FIRST] - x[:, STEP_FIRST]
            out[f"margin@{slot}"] = x[:, STEP_MARGIN] - x[:, MARGIN]
        return ids, {k: torch.nan_to_num(v, nan=0.0) for k, v in out.items()}

    def judge(
        self,
        *,
        min_sightings: int,
        zscore: float,
        gain_weight: float = 0.0,
        exclude=(),
        min_population: int = 64,
        early_zscore: float | None = None,
    ) -> list[TrajectoryVerdict]:
        """The records whose trajectory stands out (see the module docstring), highest score first. Pure in the
        table: every rank names the same records. `exclude`: record ids not to name (already quarantined); they
        are left out of the population too. `early_zscore`: records seen at least once but fewer than
        `min_sightings` times are judged too, against this higher bar (one sighting's evidence: its first and
        latest sighting are the same); None: not before `min_sightings`."""
        ids, feats = self.features(1 if early_zscore is not None else min_sightings)
        keep = torch.tensor([int(i) not in exclude for i in ids.tolist()], dtype=torch.bool)
        ids = ids[keep]
        if ids.numel() < min_population:
            return []
        z, population = {}, {"records": int(ids.numel())}
        for name, values in feats.items():
            med, scale = _robust(values[keep])
            z[name] = (values[keep] - med) / scale
            population[name] = {"median": round(med, 6), "scale": round(scale, 6)}
        gain = self.gains[ids, 0].double()
        bonus = torch.log(torch.nan_to_num(gain, nan=1.0).clamp_min(1.0)) * gain_weight
        score = sum(z.values()) / len(z) + bonus
        early = self.seen[ids] < min_sightings
        bar = torch.where(early, math.inf if early_zscore is None else early_zscore, zscore)
        rule = (
            f"mean robust z of answer nats / first-token NLL / margin below the step median, at the first and the "
            f"latest sighting, + {gain_weight:g} x ln(prompt gain, if above 1) > {zscore:g} "
            f"(records seen >= {min_sightings} times"
            + (f"; > {early_zscore:g} seen fewer times)" if early_zscore is not None else ")")
        )
        named = sorted(
            (i for i in range(ids.numel()) if float(score[i]) > float(bar[i])),
            key=lambda i: (-float(score[i]), int(ids[i])),
        )
        out = []
        for i in named:
            r = int(ids[i])
            ev = self.evidence(r)
            ev.update({f"z_{k}": round(float(v[i]), 4) for k, v in z.items()})
            ev.update({"score": round(float(score[i]), 4), "threshold": float(bar[i]), "rule": rule})
            ev["population"] = population
            out.append(TrajectoryVerdict(r, float(score[i]), ev))
        return out

    def evidence(self, record_id: int) -> dict:
        """The record's sightings: step, loss and the step's median loss, answer nats, first-token NLL and margin
        (each with the step's median); screening's prompt gain."""
        k = int(min(int(self.seen[record_id]), self.max_sightings))
        h = self.hist[record_id, :k].tolist()
        gain = float(self.gains[record_id, 0])

        def col(c):
            return [round(x[c], 4) for x in h]

        return {
            "sightings": int(self.seen[record_id]),
            "steps": [int(x[STEP]) for x in h],
            "losses": col(LOSS),
            "step_median_losses": col(STEP_LOSS),
            "answer_nats": col(NATS),
            "step_median_answer_nats": col(STEP_NATS),
            "first_token_nll": col(FIRST),
            "step_median_first_token_nll": col(STEP_FIRST),
            "margins": col(MARGIN),
            "step_median_margins": col(STEP_MARGIN),
            "prompt_gain": round(gain, 4) if math.isfinite(gain) else math.nan,
        }

    # --- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-safe and exact: the tensors' bytes, base64 (cached until the table changes: this is called every
        step)."""
        if self._state is None:
            enc = lambda t: base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")
            self._state = {
                "records": len(self),
                "max_sightings": self.max_sightings,
                "channels": CHANNELS,
                "hist": enc(self.hist),
                "seen": enc(self.seen),
                "tokens": enc(self.tokens),
                "gains": enc(self.gains),
            }
        return self._state

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        n, k = int(state["records"]), int(state["max_sightings"])
        if int(state.get("channels", 7)) != CHANNELS:  # a history kept by an earlier version: start afresh
            logger.warning(
                "the checkpoint's trajectory history has another layout (an earlier hf_stable): starting it afresh"
            )
            return

        def dec(key, dtype, shape):
            raw = bytearray(base64.b64decode(state.get(key, "")))
            if not raw:
                return torch.full(shape, math.nan if dtype.is_floating_point else 0, dtype=dtype)
            return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()

        self.max_sightings = k
        self.hist = dec("hist", torch.float32, (n, k, CHANNELS))
        self.seen = dec("seen", torch.int32, (n,))
        self.tokens = dec("tokens", torch.float32, (n,))
        self.gains = dec("gains", torch.float32, (n, 2))
        self._buffer = []
        self._state = None
