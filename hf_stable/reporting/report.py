"""The training-stability report: `hf-stable report OUTPUT_DIR`, and the section the model card embeds.

Inputs are what a run leaves in its output dir: `stability_events.jsonl` (alerts and actions of every hf_stable
callback) and `trainer_state.json`'s `log_history` (the namespaced metrics the monitors put in the Trainer's
logs; taken from the newest `checkpoint-*/` when the run did not save one at the top). Output: PNG plots and
`stability_report.md` in `OUTPUT_DIR/report/`. `render_report` returns the same markdown with image links
relative to OUTPUT_DIR, for the model card (README.md) in that directory.

    hf-stable report outputs/default
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

from hf_stable.checkpoints import list_checkpoints
from hf_stable.core.events import EVENTS_FILE, read_events
from hf_stable.errors import HfStableError
from hf_stable.logging import get_logger
from hf_stable.reporting import posttrain_plots, stability_plots
from hf_stable.reporting.suspect_data import plot_bad_step_losses, suspect_markdown

logger = get_logger("report")

REPORT_DIR = "report"
REPORT_FILE = "stability_report.md"
MAX_EVENT_ROWS = 50


class ReportError(HfStableError):
    """The directory given to `hf-stable report` is not a training output directory."""


def load_log_history(output_dir: str | Path) -> list[dict]:
    """`log_history` of OUTPUT_DIR/trainer_state.json, else of the newest checkpoint; [] when there is none."""
    root = Path(output_dir)
    candidates = [root / "trainer_state.json"] + [p / "trainer_state.json" for p in reversed(list_checkpoints(root))]
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8")).get("log_history", [])
    return []


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _events_markdown(events: list[dict]) -> list[str]:
    alerts = [e for e in events if e.get("severity") != "info"]
    notes = [e for e in events if e.get("severity") == "info"]
    if not events:
        return ["No stability events were recorded: no alert fired and no guard acted."]
    by_severity = Counter(e.get("severity", "warning") for e in events)
    lines = [
        (
            f"{len(events)} event(s): {by_severity.get('error', 0)} error, "
            f"{by_severity.get('warning', 0)} warning, {by_severity.get('info', 0)} info."
        ),
        "",
        "| kind | count | first step | last step |",
        "|---|---:|---:|---:|",
    ]
    kinds: dict[str, list[int]] = {}
    for e in events:
        kinds.setdefault(e["kind"], []).append(int(e["step"]))
    for kind, steps in sorted(kinds.items(), key=lambda kv: min(kv[1])):
        lines.append(f"| {kind} | {len(steps)} | {min(steps)} | {max(steps)} |")
    lines += [
        "",
        "| step | kind | severity | group | value | threshold | message |",
        "|---:|---|---|---|---:|---:|---|",
    ]
    shown = (alerts + notes)[:MAX_EVENT_ROWS]
    for e in sorted(shown, key=lambda e: (int(e["step"]), e.get("time", 0))):
        lines.append(
            "| "
            + " | ".join(
                _cell(e.get(k)) for k in ("step", "kind", "severity", "group", "value", "threshold", "message")
            )
            + " |"
        )
    if len(events) > len(shown):
        lines.append(f"\n{len(events) - len(shown)} more event(s) in `{EVENTS_FILE}`.")
    return lines


def _finite(values):
    return [v for _, v in values if math.isfinite(v)]


def _glance(history: list[dict]) -> list[str]:
    rows = []
    loss = stability_plots.series(history, "loss/train") or stability_plots.series(history, "loss")
    if loss:
        finite = _finite(loss)
        bad = len(loss) - len(finite)
        if finite:
            rows.append(("train loss (first → last finite, logged steps)", f"{finite[0]:.4g} → {finite[-1]:.4g}"))
        if bad:
            rows.append(("non-finite logged losses", str(bad)))
    evals = _finite(stability_plots.series(history, "eval_loss"))
    if evals:
        rows.append(("eval loss (first → last)", f"{evals[0]:.4g} → {evals[-1]:.4g}"))
    norms = stability_plots.series(history, "grad/norm_global")
    if norms:
        finite = _finite(norms)
        rows.append(
            (
                "grad norm (median / max finite)",
                f"{sorted(finite)[len(finite) // 2]:.3g} / {max(finite):.3g}" if finite else "none finite",
            )
        )
    for key, label in (("mem/peak_gib", "peak CUDA memory (GiB)"), ("mem/rss_gib", "max process RSS (GiB)")):
        values = _finite(stability_plots.series(history, key))
        if values:
            rows.append((label, f"{max(values):.3g}"))
    tps = _finite(stability_plots.series(history, "perf/tokens_per_s"))
    if tps:
        rows.append(("tokens/s (median)", f"{sorted(tps)[len(tps) // 2]:.4g}"))
    ratio = _finite(stability_plots.series(history, "perf/data_wait_ratio"))
    if ratio:
        rows.append(("data wait / compute (max)", f"{max(ratio):.3g}"))
    if not rows:
        return []
    return ["| quantity | value |", "|---|---:|", *[f"| {k} | {v} |" for k, v in rows]]


def _build(output_dir: Path, history: list[dict], events: list[dict], link_prefix: str, plots: bool) -> str:
    lines = ["### At a glance", ""]
    glance = _glance(history)
    lines += glance or ["The log history holds no monitor metrics (were the hf_stable monitors on?)."]
    lines += ["", "### Events", "", *_events_markdown(events)]
    suspects = suspect_markdown(output_dir, events)
    if suspects:
        lines += ["", "### Suspect data", "", *suspects]
    if plots:
        folder = output_dir / REPORT_DIR
        wanted = [
            ("loss", stability_plots.plot_loss, (history, events, folder / "loss.png")),
            ("learning rate", stability_plots.plot_lr, (history, folder / "learning_rate.png")),
            (
                "gradient norms per group",
                stability_plots.plot_grad_norms,
                (history, events, folder / "grad_norms.png"),
            ),
            ("memory", stability_plots.plot_memory, (history, folder / "memory.png")),
            ("per-sample loss of bad steps", plot_bad_step_losses, (events, folder / "bad_step_samples.png")),
            ("RL signals", posttrain_plots.plot_rl, (history, events, folder / "posttrain_rl.png")),
            ("preference signals", posttrain_plots.plot_preference, (history, events, folder / "posttrain_pref.png")),
        ]
        drawn, failed = [], []
        for title, draw, draw_args in wanted:
            try:
                path = draw(*draw_args)
            except Exception as e:  # noqa: BLE001 - a plot must never turn a finished run into a crash
                failed.append(f"the {title} plot could not be drawn ({type(e).__name__}: {str(e)[:200]})")
                logger.warning("%s", failed[-1])
                continue
            if path is not None:
                drawn.append((title, path))
        if drawn or failed:
            lines += ["", "### Plots", ""]
            lines += [f"![{title}]({link_prefix}{path.name})" for title, path in drawn]
            lines += [f"- {note}" for note in failed]
    return "\n".join(lines) + "\n"


def render_report(output_dir: str | Path, log_history: list[dict] | None = None, plots: bool = True) -> str:
    """Write the plots into OUTPUT_DIR/report/ and return the report markdown (image links relative to
    OUTPUT_DIR, for the model card). `log_history` defaults to the one saved in OUTPUT_DIR.

    Example:
        >>> section = render_report("outputs/default", trainer.state.log_history)
    """
    output_dir = Path(output_dir)
    history = load_log_history(output_dir) if log_history is None else log_history
    return _build(output_dir, history, read_events(output_dir), f"{REPORT_DIR}/", plots)


def write_report(output_dir: str | Path, log_history: list[dict] | None = None) -> Path:
    """Write OUTPUT_DIR/report/stability_report.md (and its plots); returns its path.

    Raises:
        ReportError: when OUTPUT_DIR is missing or holds neither a trainer state nor an events file.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise ReportError(f"{output_dir}: no such directory; pass the output_dir of a training run")
    history = load_log_history(output_dir) if log_history is None else log_history
    if not history and not (output_dir / EVENTS_FILE).is_file():
        raise ReportError(
            f"{output_dir}: found neither trainer_state.json (top level or checkpoint-*/) nor {EVENTS_FILE}; "
            "is this a training output dir? (the Trainer writes trainer_state.json with each checkpoint, or "
            "call trainer.save_state() at the end)"
        )
    body = _build(output_dir, history, read_events(output_dir), "", plots=True)
    path = output_dir / REPORT_DIR / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# Training stability report: {output_dir.name}\n\n{body}", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-stable report", description="Render the stability report of a run.")
    parser.add_argument("output_dir", help="the run's output directory (TrainingArguments.output_dir)")
    args = parser.parse_args(argv)
    path = write_report(args.output_dir)
    print(path)
    return 0
