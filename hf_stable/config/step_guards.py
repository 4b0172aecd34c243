"""Config sections of the guards that judge each step: skipping a bad step and rolling back after several (their
rules measure against the run's own noise; see `hf_stable/callbacks/guards/skip_guard.py`). Re-exported by
`hf_stable.config.guards`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_stable.config.fields import check_positive, check_unit_interval
from hf_stable.config.fields import help_ as _h


@dataclass
class SkipConfig:
    """Skip a step (every rank together) on non-finite gradients or loss, or a grad-norm / loss spike."""

    enabled: bool = field(default=True, metadata=_h("Skip bad optimizer steps."))
    nonfinite: bool = field(default=True, metadata=_h("Skip when any gradient or the step loss is NaN/Inf."))
    damage_rules: bool = field(
        default=True,
        metadata=_h(
            "GRPO/RLOO under stabilize: skip a step whose old/sampling log-probs are NaN/Inf or whose importance "
            "ratio exceeds 1000 on some completion token (reason 'damaged')."
        ),
    )
    grad_spike_ratio: float | None = field(
        default=10.0, metadata=_h("Skip when the pre-clip global grad norm exceeds this x its EMA ... null = off.")
    )
    grad_spike_zscore: float | None = field(
        default=6.0,
        metadata=_h(
            "... and its log is this many robust standard deviations above the window's median log grad norm "
            "(both must hold; null = the ratio alone)."
        ),
    )
    grad_norm_max: float | None = field(
        default=None, metadata=_h("Skip when the pre-clip global grad norm exceeds this absolute value. null = off.")
    )
    loss_spike_zscore: float | None = field(
        default=6.0,
        metadata=_h(
            "Skip when the log of the step loss is this many standard deviations of the step noise (1.4826 MAD "
            "of the differences of successive log losses in the window, / sqrt 2: the run's own noise, a trend "
            "left out) above the window's median log loss ..."
        ),
    )
    loss_spike_min_rel: float = field(
        default=1.0, metadata=_h("... and at least this fraction above that median (both must hold). ")
    )
    loss_rise_rel: float | None = field(
        default=0.5,
        metadata=_h(
            "Skip while the loss level (the median of the last 5 plausible step losses) is this fraction above "
            "the window's lowest smoothed loss (a divergence under way; these steps count towards a rollback) "
            "... null = off."
        ),
    )
    loss_rise_zscore: float | None = field(
        default=6.0,
        metadata=_h(
            "... and that rise (in log) is this many standard deviations of its noise (the step noise through the "
            "median of 5 and the smoothed loss). null = the fraction alone."
        ),
    )
    ema_beta: float = field(default=0.95, metadata=_h("EMA decay of the grad-norm reference."))
    window: int = field(default=50, metadata=_h("Accepted steps of loss / grad-norm history for the noise estimates."))
    warmup_steps: int = field(
        default=3,
        metadata=_h(
            "No spike or rise verdict before this many accepted steps (until the window holds 3-10, the noise "
            "estimates fall back on the relative margins)."
        ),
    )
    max_consecutive_skips: int = field(
        default=25,
        metadata=_h(
            "After this many consecutive spike skips the level is the new normal: the next step is accepted "
            "and the references restart (non-finite steps are always skipped)."
        ),
    )

    def validate(self) -> list[str]:
        out: list[str] = []
        check_positive(
            self,
            ("grad_spike_ratio", "grad_spike_zscore", "grad_norm_max", "loss_spike_zscore", "loss_rise_rel"),
            out,
        )
        check_positive(self, ("loss_rise_zscore",), out, strict=False)
        check_positive(self, ("loss_spike_min_rel",), out, strict=False)
        check_unit_interval(self, ("ema_beta",), out)
        if self.grad_spike_ratio is not None and self.grad_spike_ratio <= 1:
            out.append(f"grad_spike_ratio: got {self.grad_spike_ratio}, must be > 1 (or null)")
        if self.window < 3:
            out.append(f"window: got {self.window}, must be >= 3")
        if self.warmup_steps < 1 or self.max_consecutive_skips < 1:
            out.append(
                f"warmup_steps/max_consecutive_skips: got {self.warmup_steps}/{self.max_consecutive_skips}, "
                "both must be >= 1"
            )
        return out


@dataclass
class RollbackConfig:
    """Snapshot the trainable weights + optimizer state every N good steps; after K bad steps in a window restore
    the snapshot exactly and multiply the LR by a backoff. Needs `skip.enabled` (the skip guard judges steps)."""

    enabled: bool = field(default=True, metadata=_h("Roll back after repeated bad steps."))
    snapshot_every: int = field(default=50, metadata=_h("At most this many good steps between snapshots."))
    snapshot_share: float | None = field(
        default=0.1,
        metadata=_h(
            "Also snapshot once the good steps since the last snapshot reach this share of the steps done "
            "(at least snapshot_min_every), so a rollback undoes about this share of the run. null = only "
            "every snapshot_every."
        ),
    )
    snapshot_min_every: int = field(
        default=10, metadata=_h("Never snapshot more often than every this many good steps.")
    )
    bad_steps: int = field(default=3, metadata=_h("Roll back after this many skipped (bad) steps ..."))
    window: int = field(default=20, metadata=_h("... within this many optimizer steps."))
    lr_backoff: float = field(default=0.5, metadata=_h("Multiply the LR factor by this at each rollback."))
    escalate: bool = field(
        default=True,
        metadata=_h(
            "A rollback to the same snapshot after the run had recovered (>= 1 good step) raises the "
            "backoff exponent (x0.5, x0.25, x0.125): the LR overshoots by more than one backoff."
        ),
    )
    verify: bool = field(
        default=True,
        metadata=_h(
            "Before restoring, re-run the step's batch and the last verify_batches accepted steps' batches at "
            "the current and the snapshot's weights; restore only when the snapshot does clearly better on them "
            "(damaged weights), else only skip (bad data or noise)."
        ),
    )
    verify_batches: int = field(
        default=4,
        metadata=_h(
            "Accepted steps' batches re-run with the bad step's by the check (more batches: a paired comparison "
            "less at the mercy of one batch's noise; 0 = the bad step's batch alone)."
        ),
    )
    verify_margin: float = field(
        default=0.1,
        metadata=_h(
            "Damaged weights: the summed loss of those batches at the current weights is at least this fraction "
            "above the snapshot's (and the snapshot's numbers pass the skip rules)."
        ),
    )
    storage: Literal["memory", "disk"] = field(
        default="memory",
        metadata=_h(
            "Where snapshots live: CPU memory (LoRA: small) or <output_dir>/hf_stable_rollback (large). "
            "A memory snapshot larger than host_memory_share of the free host memory goes to disk (with a "
            "warning); one that fits nowhere stops the run before the first step."
        ),
    )
    host_memory_share: float = field(
        default=0.5,
        metadata=_h(
            "Share of the host's available memory at train start (split over the ranks on the host) that "
            "memory snapshots and the rollback check's copy of the weights may take."
        ),
    )
    max_rollbacks: int = field(default=10, metadata=_h("After this many rollbacks only skip (an event says so)."))

    def validate(self) -> list[str]:
        out: list[str] = []
        for name in ("snapshot_every", "snapshot_min_every", "bad_steps", "window"):
            if getattr(self, name) < 1:
                out.append(f"{name}: got {getattr(self, name)}, must be >= 1")
        if self.snapshot_share is not None and not 0 < self.snapshot_share <= 1:
            out.append(f"snapshot_share: got {self.snapshot_share}, must be in (0, 1] or null")
        if not 0 < self.host_memory_share <= 1:
            out.append(f"host_memory_share: got {self.host_memory_share}, must be in (0, 1]")
        if not out and self.bad_steps > self.window:
            out.append(f"bad_steps: got {self.bad_steps}, must be <= window ({self.window})")
        if not 0.0 < self.lr_backoff <= 1.0:
            out.append(f"lr_backoff: got {self.lr_backoff}, must be in (0, 1]")
        check_positive(self, ("max_rollbacks", "verify_batches", "verify_margin"), out, strict=False)
        return out


# per_group clipping: max norm per parameter site (a site the user leaves out keeps its value here)
