"""The model card's training-curve plot: loss and learning rate in one figure (drawn by `stability_plots`)."""

from __future__ import annotations

from hf_stable.reporting.stability_plots import plot_loss_lr

__all__ = ["plot_loss_lr"]
