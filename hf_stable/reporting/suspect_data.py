"""The "suspect data" section of the report and the model card: the records the spike forensics quarantined
(``quarantine.jsonl``: file:line, reason, evidence, preview) and a plot of the bad steps' per-sample losses against
the healthy per-sample distribution (``step_forensics`` events)."""

from __future__ import annotations

import math
from pathlib import Path

from hf_stable.forensics.quarantine import QUARANTINE_FILE, read_quarantine

MAX_ROWS = 30


def _num(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _trajectory(ev: dict) -> str:
    """A trajectory verdict's evidence: losses, first-token NLL and margins by sighting against the step medians,
    the score and its bar."""
    arrow = lambda xs: " → ".join(f"{_num(x):.3g}" for x in xs)
    parts = [f"losses by sighting {arrow(ev['losses'])} (step medians {arrow(ev.get('step_median_losses', []))})"]
    if ev.get("first_token_nll"):
        parts.append(
            f"first token {arrow(ev['first_token_nll'])} (medians {arrow(ev.get('step_median_first_token_nll', []))})"
        )
    if ev.get("margins"):
        parts.append(f"margins {arrow(ev['margins'])}")
    gain = _num(ev.get("prompt_gain"))
    if not math.isnan(gain):
        parts.append(f"prompt gain {gain:.3g}")
    parts.append(f"score {_num(ev.get('score')):.3g} > {_num(ev.get('threshold')):.3g}")
    return ", ".join(parts)


def _evidence(ev: dict) -> str:
    if isinstance(ev.get("losses"), list):
        return _trajectory(ev)
    parts = [] if math.isnan(_num(ev.get("loss"))) else [f"loss {_num(ev.get('loss')):.4g}"]
    if math.isfinite(_num(ev.get("step_median"))):
        parts.append(f"step median {_num(ev['step_median']):.3g}")
    z = _num(ev.get("z"))
    if not math.isnan(z):
        parts.append(f"z {z:.3g}")
    g = _num(ev.get("grad_norm"))
    if not math.isnan(g):
        parts.append(f"grad norm {g:.3g}")
    snap = _num(ev.get("loss_at_snapshot"))
    if not math.isnan(snap):
        parts.append(f"at snapshot {snap:.3g}")
    for key, label in (("prompt_gain", "prompt gain"), ("compression", "compresses to")):
        x = _num(ev.get(key))
        if not math.isnan(x):
            parts.append(f"{label} {x:.3g}")
    return ", ".join(parts)


def suspect_table(entries: list[dict], limit: int = MAX_ROWS) -> list[str]:
    """Markdown table rows for quarantine entries (empty when there are none)."""
    if not entries:
        return []
    lines = ["| step | file:line | reason | evidence | preview |", "|---:|---|---|---|---|"]
    for e in entries[:limit]:
        lines.append(
            f"| {e.get('step')} | `{_cell(e.get('where'))}` | {_cell(e.get('reason'))} | "
            f"{_cell(_evidence(e.get('evidence') or {}))} | {_cell(e.get('preview', ''))} |"
        )
    if len(entries) > limit:
        lines.append(f"\n{len(entries) - limit} more in `{QUARANTINE_FILE}`.")
    return lines


def suspect_markdown(output_dir: str | Path, events: list[dict]) -> list[str]:
    """The section's lines (without heading); [] when the run named no suspect and ran no forensics."""
    entries = read_quarantine(output_dir)
    forensics = [e for e in events if e.get("kind") == "step_forensics"]
    if not entries and not forensics:
        return []
    if not entries:
        return [
            (
                f"{len(forensics)} bad step(s) re-run sample by sample; no record stood out (the weights or a "
                "transient fault, not the data)."
            )
        ]
    return [
        (
            f"{len(entries)} record(s) quarantined (`{QUARANTINE_FILE}`; exclude them from another run with "
            f"`data.exclude_file`, re-audit with `hf-stable audit --exclude`):"
        ),
        "",
        *suspect_table(entries),
    ]


def plot_bad_step_losses(events: list[dict], path: Path) -> Path | None:
    """Each bad step's per-sample losses over the step's median (dots, quarantined red) next to the healthy
    samples' distribution of the same ratio (box, when screening kept one). Non-finite and non-positive ratios
    cannot sit on the log axis and are left out (the suspect table names them); None when nothing is left to draw
    (e.g. a NaN forward, where every sample's loss is NaN)."""
    steps = [e for e in events if e.get("kind") == "step_forensics" and e.get("samples")]
    if not steps:
        return None
    drawable = lambda y: math.isfinite(y) and y > 0
    healthy = [_num(x) for e in steps for x in e.get("healthy") or []]
    healthy = [x for x in healthy if drawable(x)]
    quarantined = {
        (int(ev["step"]), r.get("where"))
        for ev in events
        if ev.get("kind") == "samples_quarantined"
        for r in ev.get("records") or []
    }
    columns = []
    for e in steps[:20]:
        points = []
        for sample in e["samples"]:
            where, ratio = (sample[0], sample[2]) if len(sample) >= 3 else (None, math.nan)
            y = _num(ratio)
            if drawable(y):
                points.append((y, "tab:red" if (int(e["step"]), where) in quarantined else "tab:blue"))
        columns.append((f"step {e['step']}", points))
    if not healthy and not any(points for _, points in columns):
        return None
    from hf_stable.reporting.stability_plots import _plt, _save

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    if healthy:
        ax.boxplot([healthy], positions=[0], widths=0.6)
    labels = ["healthy" if healthy else ""]
    for k, (label, points) in enumerate(columns, start=1):
        if points:
            ax.scatter([k] * len(points), [y for y, _ in points], c=[c for _, c in points], s=14, alpha=0.8)
        labels.append(label)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=45, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("sample loss / step median")
    ax.set_title("bad steps' samples (red: quarantined) vs healthy samples")
    return _save(fig, path)
