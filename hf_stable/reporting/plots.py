"""Training-curve plots for the model card (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def plot_loss_lr(log_history: list[dict], path: str | Path, title: str = "training") -> Path | None:
    """Loss (left axis) and learning rate (right axis) against step. Returns the PNG path, or None if no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    lr = [(h["step"], h["learning_rate"]) for h in log_history if "learning_rate" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h and "step" in h]
    if not loss and not lr:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    if loss:
        ax.plot(*zip(*loss), label="train loss", color="tab:blue")
    if evals:
        ax.plot(*zip(*evals), "o--", label="eval loss", color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if lr:
        ax2 = ax.twinx()
        ax2.plot(*zip(*lr), label="learning rate", color="tab:orange", alpha=0.8)
        ax2.set_ylabel("learning rate")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
        ax.legend(lines, labels, loc="upper right", fontsize=8)
    else:
        ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
