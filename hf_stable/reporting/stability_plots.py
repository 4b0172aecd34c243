"""PNG plots of the stability report, drawn from `trainer_state.json`'s log history (matplotlib, Agg backend).

Each function returns the path it wrote, or None when the history holds nothing to draw (a plot of nothing
would only suggest that something was measured). Every function copes with what a rescued or diverged run logs:
NaN and inf values (left out of the lines and of log axes, marked where they matter), empty and one-point series
(a one-point series is drawn as a marker): the end of a run must never crash on its own plots.
"""

from __future__ import annotations

import math
from pathlib import Path

SEVERITY_COLORS = {"error": "tab:red", "warning": "tab:orange", "info": "tab:gray"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series(history: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of `key` in the log history; non-numbers dropped, NaN/inf kept (drawn as gaps)."""
    out = []
    for row in history:
        value = row.get(key)
        if "step" in row and isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((int(row["step"]), float(value)))
    return out


def finite(points: list[tuple[int, float]], positive: bool = False) -> list[tuple[int, float]]:
    """The points a plot can draw: finite values (and > 0 for a log axis)."""
    return [(s, v) for s, v in points if math.isfinite(v) and (v > 0 or not positive)]


def _line(ax, points: list[tuple[int, float]], *fmt, **kw):
    """`ax.plot` of (step, value) points; NaN/inf stay gaps in the line, and a short series gets markers so one
    point is still visible."""
    if not points:
        return
    if len([1 for _, v in points if math.isfinite(v)]) <= 3 and not fmt:
        kw.setdefault("marker", "o")
        kw.setdefault("markersize", 3)
    steps, values = zip(*points, strict=False)
    ax.plot(steps, [v if math.isfinite(v) else math.nan for v in values], *fmt, **kw)


def _log_or_linear(ax, drawn_positive: bool) -> None:
    """A log y axis only when something positive and finite is drawn (log of nothing raises in matplotlib)."""
    if drawn_positive:
        ax.set_yscale("log")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    _plt().close(fig)
    return path


def _mark_events(ax, events: list[dict]) -> None:
    seen = set()
    for ev in events:
        if ev.get("severity") == "info":
            continue
        color = SEVERITY_COLORS.get(ev.get("severity"), "tab:red")
        label = None if ev["kind"] in seen else ev["kind"]
        seen.add(ev["kind"])
        ax.axvline(ev["step"], color=color, alpha=0.5, linestyle=":", label=label)


def draw_loss(ax, history: list[dict], events: list[dict]) -> bool:
    """Train loss (per step when `loss/train` is logged, else the Trainer's logged mean), eval loss, non-finite
    losses and alert lines on `ax`; False when the history holds no loss. The one loss drawing of every plot."""
    logged = series(history, "loss")
    per_step = series(history, "loss/train")
    evals = series(history, "eval_loss")
    if not (logged or per_step or evals):
        return False
    if per_step:
        _line(ax, per_step, label="train loss (each step)", color="tab:blue", linewidth=1)
    if logged and not per_step:
        _line(ax, logged, label="train loss (mean over each logging interval)", color="tab:blue")
    if finite(evals):
        _line(ax, finite(evals), "o--", label="eval loss", color="tab:green")
    nonfinite = [s for s, v in per_step or logged if not math.isfinite(v)]
    if nonfinite:
        top = ax.get_ylim()[1]
        ax.plot(nonfinite, [top] * len(nonfinite), "x", color="tab:red", label="non-finite loss")
    _mark_events(ax, events)
    ax.set(xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    return True


def draw_lr(ax, history: list[dict]) -> bool:
    """The logged learning rate (the LR applied, see docs/guards.md) on `ax`; False when none is logged."""
    lr = finite(series(history, "learning_rate"))
    if not lr:
        return False
    _line(ax, lr, label="learning rate", color="tab:orange", alpha=0.8, linestyle="--")
    ax.set(xlabel="step", ylabel="learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    return True


def _drawn(fig, drew: bool, path: Path) -> Path | None:
    if not drew:
        _plt().close(fig)
        return None
    return _save(fig, Path(path))


def plot_loss(history: list[dict], events: list[dict], path: Path) -> Path | None:
    fig, ax = _plt().subplots(figsize=(7, 3.5), dpi=100)
    drew = draw_loss(ax, history, events)
    ax.set_title("loss (dotted lines: alerts)")
    if drew:
        ax.legend(fontsize=7, loc="upper right")
    return _drawn(fig, drew, path)


def plot_lr(history: list[dict], path: Path) -> Path | None:
    fig, ax = _plt().subplots(figsize=(7, 2.5), dpi=100)
    drew = draw_lr(ax, history)
    ax.set_title("learning rate")
    ax.grid(alpha=0.3)
    return _drawn(fig, drew, path)


def plot_loss_lr(history: list[dict], path: Path, title: str = "training", events: list[dict] = ()) -> Path | None:
    """Loss (left axis) and learning rate (right axis) in one figure, drawn by `draw_loss` and `draw_lr`."""
    fig, ax = _plt().subplots(figsize=(7, 3.5), dpi=100)
    ax2 = ax.twinx()
    drew_loss, drew_lr = draw_loss(ax, history, list(events)), draw_lr(ax2, history)
    if not drew_lr:
        ax2.set_axis_off()
    ax.set_zorder(ax2.get_zorder() + 1)  # the loss is drawn over the LR line, not under it
    ax.patch.set_visible(False)
    (h1, l1), (h2, l2) = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    handles, labels = h1 + h2, l1 + l2
    if handles:
        ax.legend(handles, labels, loc="upper right", fontsize=8)
    ax.set_title(title)
    return _drawn(fig, drew_loss or drew_lr, path)


def plot_grad_norms(history: list[dict], events: list[dict], path: Path, max_lines: int = 8) -> Path | None:
    """Global norm plus per-group norms: lines for a few groups, a log10 heat map for many."""
    groups = sorted(
        {k[len("grad/norm/") :] for row in history for k in row if k.startswith("grad/norm/")}, key=_group_order
    )
    total = finite(series(history, "grad/norm_global") or series(history, "grad_norm"), positive=True)
    groups = [g for g in groups if finite(series(history, f"grad/norm/{g}"), positive=True)]
    if not (groups or total):
        return None
    plt = _plt()
    if len(groups) <= max_lines:
        fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
        _line(ax, total, color="black", linewidth=1.5, label="global")
        for g in groups:
            _line(ax, finite(series(history, f"grad/norm/{g}"), positive=True), linewidth=1, label=g)
        _log_or_linear(ax, True)
        _mark_events(ax, [e for e in events if e["kind"].startswith(("grad_", "nonfinite"))])
        ax.set(xlabel="step", ylabel="grad L2 norm", title="gradient norms (pre-clip when max_grad_norm=0)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2, loc="upper right")
        return _save(fig, path)
    import numpy as np

    steps = sorted({s for g in groups for s, _ in series(history, f"grad/norm/{g}")})
    col = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(groups), len(steps)), np.nan)
    for r, g in enumerate(groups):
        for s, v in series(history, f"grad/norm/{g}"):
            grid[r, col[s]] = math.log10(v) if v > 0 and math.isfinite(v) else np.nan
    fig, (ax0, ax1) = plt.subplots(
        2,
        1,
        figsize=(8, 2.5 + 0.14 * len(groups)),
        dpi=100,
        gridspec_kw={"height_ratios": [1, max(2, len(groups) // 6)]},
        sharex=False,
    )
    if total:
        _line(ax0, total, color="black", linewidth=1.2)
        ax0.set_yscale("log")
    ax0.set(
        ylabel="global norm",
        title="gradient norms (pre-clip when max_grad_norm=0)",
        xlim=(steps[0] - 0.5, steps[-1] + 0.5),
    )
    ax0.grid(alpha=0.3)
    image = ax1.imshow(
        np.ma.masked_invalid(grid),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(groups) - 0.5, -0.5),
    )
    ax1.set_yticks(range(len(groups)), groups, fontsize=6)
    ax1.set_xlabel("step")
    fig.colorbar(image, ax=ax1, label="log10 group norm")
    return _save(fig, path)


def _group_order(name: str):
    site = name.split(".")[0]
    rank = {"embeddings": 0, "norm": 2, "lm_head": 3, "other": 4}.get(site, 1)
    layer = int(site.split("_")[1]) if site.startswith("layer_") and site[6:].isdigit() else -1
    return rank, layer, name


def plot_memory(history: list[dict], path: Path) -> Path | None:
    keys = [
        k
        for k in ("mem/allocated_gib", "mem/reserved_gib", "mem/peak_gib", "mem/rss_gib")
        if finite(series(history, k))
    ]
    if not keys:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3), dpi=100)
    for k in keys:
        _line(ax, finite(series(history, k)), label=k.split("/")[1].replace("_gib", ""))
    ax.set(xlabel="step", ylabel="GiB", title="memory")
    ax.grid(alpha=0.3)
    frag = finite(series(history, "mem/fragmentation"))
    if frag:
        ax2 = ax.twinx()
        _line(ax2, frag, color="tab:gray", linestyle="--", label="fragmentation")
        ax2.set_ylabel("fragmentation")
        ax2.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)
