"""The run's stability verdict: one word, the counts behind it and one line of advice naming the likely cause.

Written into `run_summary.json` as `stability`, shown in the model card and, when the run was not healthy, as the
recipe's last console line. It is read from what the run left in its output dir (`stability_events.jsonl`,
`quarantine.jsonl`, the log history), so `hf-stable report` and a custom Trainer script get the same answer.

Verdicts (docs/outputs-and-resume.md; the recipe exits 0 with each, the run finished and saved its weights):

- `healthy`: no guard acted and no alert of warning or error level was written.
- `warned`: no guard acted, but a monitor alert of warning/error level was written (read the events).
- `rescued`: guards acted (skipped steps, at most one rollback) and the run ended on finite losses.
- `diverged`: the weights went bad more than once (two or more rollbacks, so the LR back-offs stacked), the
  rollbacks ran out (`rollback_exhausted`), the guards skipped a large share of the steps (at least
  `DIVERGED_SKIP_SHARE` of them and at least `DIVERGED_MIN_SKIPS`: training mostly did not happen), or the run ended
  on a non-finite loss.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from hf_stable.core.events import LR_SIGNS, read_events
from hf_stable.forensics.quarantine import read_quarantine

VERDICTS = ("healthy", "warned", "rescued", "diverged")
DIVERGED_SKIP_SHARE = 0.2
DIVERGED_MIN_SKIPS = 5
# events about the set-up (a guard or monitor that cannot act here, a config caveat), not about the run's health
SETUP_KINDS = frozenset(
    {"guard_off", "guard_notice", "monitor_off", "monitor_notice", "attn_monitor_inactive", "info", "hf_stable"}
)


def _last_loss(history: list[dict]) -> float | None:
    for key in ("loss/train", "loss"):
        values = [row[key] for row in history if isinstance(row.get(key), (int, float))]
        if values:
            return float(values[-1])
    return None


def stability_verdict(
    events: list[dict], quarantined: int = 0, history: list[dict] = (), lr: float | None = None
) -> dict:
    """The `stability` section of run_summary.json from the run's events, its quarantine count and log history.

    Args:
        events: the run's stability events (`read_events`).
        quarantined: records the forensics quarantined.
        history: the Trainer's log history (its last train loss decides whether the run ended finite).
        lr: the configured learning rate, to name a lower one in the advice.
    """
    kinds = Counter(e.get("kind") for e in events)
    health = [e for e in events if e.get("kind") not in SETUP_KINDS]
    skips, rollbacks = kinds["step_skipped"], kinds["rollback"]
    factors = [float(e["lr_factor"]) for e in events if e.get("kind") == "rollback" and e.get("lr_factor") is not None]
    factor = factors[-1] if factors else 1.0
    warnings = sum(1 for e in health if e.get("severity") == "warning")
    errors = sum(1 for e in health if e.get("severity") == "error")
    last = _last_loss(list(history))
    ended_nonfinite = last is not None and not math.isfinite(last)
    nonfinite = kinds["nonfinite_grad"] + kinds["nonfinite_loss"]
    steps = max([int(row["step"]) for row in history if isinstance(row.get("step"), int)], default=0)
    mostly_skipped = skips >= DIVERGED_MIN_SKIPS and skips >= DIVERGED_SKIP_SHARE * max(steps, 1)
    if rollbacks >= 2 or kinds["rollback_exhausted"] or ended_nonfinite or mostly_skipped:
        verdict = "diverged"
    elif skips or rollbacks or quarantined:
        verdict = "rescued"
    elif warnings or errors:
        verdict = "warned"
    else:
        verdict = "healthy"
    return {
        "verdict": verdict,
        "counts": {
            "skips": skips,
            "rollbacks": rollbacks,
            "lr_factor": factor,
            "quarantined_records": quarantined,
            "nonfinite_steps": nonfinite,
            "warnings": warnings,
            "errors": errors,
        },
        "advice": _advice(verdict, kinds, factor, quarantined, skips, nonfinite, ended_nonfinite, lr, steps),
    }


def _advice(verdict, kinds, factor, quarantined, skips, nonfinite, ended_nonfinite, lr, steps) -> str:
    rollbacks = kinds["rollback"]
    if verdict == "healthy":
        return "nothing to do: no guard acted and no alert was raised"
    lower = f" (e.g. training.learning_rate <= {lr * factor:.2g})" if lr and factor < 1 else ""
    if verdict == "diverged":
        if ended_nonfinite and not rollbacks:
            return "the run ended on a non-finite loss: lower the learning rate or check precision (fp16 overflow)"
        if rollbacks < 2 and not kinds["rollback_exhausted"]:
            return (
                f"the learning rate: {skips} of {steps} steps were skipped (gradient spikes and non-finite steps, "
                f"{quarantined} record(s) blamed): the weights went bad, not the data; rerun with a lower learning rate"
                + (f" (e.g. training.learning_rate <= {lr / 10:.2g})" if lr else "")
            )
        return (
            f"the learning rate: the weights went bad {rollbacks} time(s), each rollback restored good weights and "
            f"the LR back-offs stacked to x{factor:.3g}; rerun with a lower learning rate{lower}"
        )
    if quarantined:
        return (
            f"the data: the forensics named {quarantined} record(s) (quarantine.jsonl); exclude them with "
            "data.exclude_file and rerun"
        )
    if rollbacks:
        return f"one rollback restored good weights (LR x{factor:.3g}): if it recurs, lower the learning rate{lower}"
    if skips and nonfinite:
        return (
            f"{skips} step(s) skipped for non-finite values, nothing quarantined: a transient fault; if it "
            "repeats, check precision (fp16 overflow) and the batches at those steps"
        )
    if skips:
        pairs = "; the skipped steps' pairs are in skipped_pairs.jsonl" if kinds["step_pairs"] else ""
        return f"{skips} spike step(s) skipped, nothing quarantined: if spikes recur, lower the learning rate{pairs}"
    alerts = sorted({e for e, n in kinds.items() if e not in SETUP_KINDS and n})
    lr_signs = [k for k in LR_SIGNS if kinds[k]]
    if lr_signs:
        return (
            f"the learning rate is the likely cause: {', '.join(lr_signs)} (attention saturating, gradients "
            f"exploding or the loss accelerating upwards); rerun with a lower learning rate"
            + (f" (e.g. training.learning_rate <= {lr / 10:.2g})" if lr else "")
        )
    return f"monitor alerts ({', '.join(alerts[:4])}{' ...' if len(alerts) > 4 else ''}): see stability_events.jsonl"


def run_verdict(output_dir: str | Path, history: list[dict] = (), lr: float | None = None) -> dict:
    """`stability_verdict` of the run in `output_dir` (its events and quarantine files)."""
    return stability_verdict(read_events(output_dir), len(read_quarantine(output_dir)), history, lr)


def verdict_line(stability: dict) -> str | None:
    """The console's last line for a run that was not healthy (None when it was)."""
    if not stability or stability.get("verdict") == "healthy":
        return None
    c = stability.get("counts", {})
    counts = (
        f"{c.get('skips', 0)} skipped, {c.get('rollbacks', 0)} rollbacks, LR x{c.get('lr_factor', 1.0):.3g}, "
        f"{c.get('quarantined_records', 0)} quarantined, {c.get('warnings', 0)} warnings"
    )
    return f"stability: {stability['verdict'].upper()} ({counts}): {stability.get('advice', '')}"


def verdict_markdown(stability: dict | None) -> str:
    """The model card's verdict paragraph."""
    if not stability:
        return ""
    c = stability.get("counts", {})
    return (
        f"**Stability verdict: {stability['verdict']}.** {stability.get('advice', '')}\n\n"
        f"Skipped steps {c.get('skips', 0)}, rollbacks {c.get('rollbacks', 0)}, final LR factor "
        f"{c.get('lr_factor', 1.0):.3g}, quarantined records {c.get('quarantined_records', 0)}, warnings "
        f"{c.get('warnings', 0)}, errors {c.get('errors', 0)}."
    )
