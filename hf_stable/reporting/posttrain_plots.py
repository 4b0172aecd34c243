"""The report's post-training plots, from the ``posttrain/*`` values `PostTrainMonitor` logs (TRL's own signals).

* `plot_rl` (GRPO, RLOO: drawn when the run logged a reward): reward (and its spread), KL to the reference,
  entropy, completion length, one panel each;
* `plot_preference` (DPO, KTO: drawn when the run logged a margin): the margin, the chosen / rejected log-probs,
  the reward accuracy.

A panel is drawn only when the run logged its signal, a figure only when one panel is; alert lines mark the
post-training events and skipped steps. As every report plot (`stability_plots`) they cope with NaN / inf / empty /
one-point series; a log axis (KL, which is reported in the billions when a run blows up) draws only values above
1e-200 (matplotlib overflows on a log axis holding 1e-300).
"""

from __future__ import annotations

from pathlib import Path

from hf_stable.reporting.stability_plots import _line, _mark_events, _plt, _save, finite, series

NS = "posttrain/"
LOG_FLOOR = 1e-200  # smaller positive values are left off a log axis

# (y label, [(TRL key, legend label)], log axis)
RL_PANELS = [
    ("reward", [("reward", "reward (mean)"), ("reward_std", "reward std")], False),
    ("KL to reference", [("kl", "kl")], True),
    ("entropy", [("entropy", "entropy")], False),
    (
        "completion length",
        [("completions/mean_length", "mean length"), ("completions/max_length", "max length")],
        False,
    ),
]
PREFERENCE_PANELS = [
    ("margin", [("rewards/margins", "margin (chosen - rejected reward)")], False),
    ("log-prob", [("logps/chosen", "chosen"), ("logps/rejected", "rejected")], False),
    ("reward accuracy", [("rewards/accuracies", "accuracy")], False),
]
# the events drawn as alert lines on these plots
MARKED = {
    "step_skipped",
    "step_pairs",
    "reward_nonfinite",
    "no_learning_signal",
    "likelihood_displacement",
    "margin_runaway",
}


def _points(history: list[dict], key: str, log: bool) -> list[tuple[int, float]]:
    points = finite(series(history, NS + key))
    return [(s, v) for s, v in points if v > LOG_FLOOR] if log else points


def _plot(history: list[dict], events: list[dict], path: Path, title: str, panels) -> Path | None:
    """One panel per signal the run logged (the first panel's keys are the trainer's own: without them, nothing)."""
    if not any(finite(series(history, NS + key)) for key, _ in panels[0][1]):
        return None
    drawable = []
    for ylabel, keys, log in panels:
        lines = [(label, pts) for key, label in keys if (pts := _points(history, key, log))]
        if lines:
            drawable.append((ylabel, lines, log))
    if not drawable:
        return None
    fig, axes = _plt().subplots(len(drawable), 1, figsize=(7, 2.2 * len(drawable) + 0.6), dpi=100, sharex=True)
    axes = [axes] if len(drawable) == 1 else list(axes)
    marked = [e for e in events if e.get("kind") in MARKED and isinstance(e.get("step"), int | float)]
    for ax, (ylabel, lines, log) in zip(axes, drawable, strict=True):
        for label, pts in lines:
            _line(ax, pts, label=label, linewidth=1)
        if log:
            ax.set_yscale("log")
        _mark_events(ax, marked)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    return _save(fig, Path(path))


def plot_rl(history: list[dict], events: list[dict], path: Path) -> Path | None:
    """GRPO / RLOO signals (reward, KL, entropy, completion length); None when the run logged none of them."""
    return _plot(history, events, path, "RL signals (TRL's, logged as posttrain/*; dotted lines: alerts)", RL_PANELS)


def plot_preference(history: list[dict], events: list[dict], path: Path) -> Path | None:
    """DPO / KTO signals (margin, chosen / rejected log-probs, accuracy); None when the run logged none of them."""
    return _plot(
        history,
        events,
        path,
        "preference signals (TRL's, logged as posttrain/*; dotted lines: alerts)",
        PREFERENCE_PANELS,
    )
