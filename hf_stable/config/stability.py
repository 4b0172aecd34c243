"""Config sections for the stability monitors and guards."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_stable.config.fields import help_ as _h
from hf_stable.config.guards import GuardsConfig


@dataclass
class GradMonitorConfig:
    """Gradient health: global / per-group L2 norms, max |grad| and where, non-finite tensors per group."""

    enabled: bool = field(default=True, metadata=_h("Compute gradient statistics at every check step."))
    every_n_steps: int = field(default=1, metadata=_h("Check every N optimizer steps (one host transfer each)."))
    explosion_norm: float = field(default=1e4, metadata=_h("Alert when the global grad norm exceeds this."))
    vanishing_norm: float = field(default=1e-6, metadata=_h("Global grad norm below this counts as vanishing."))
    vanishing_patience: int = field(default=10, metadata=_h("Consecutive vanishing checks before alerting."))
    max_abs: float = field(default=1e3, metadata=_h("Alert when one gradient element's |value| exceeds this."))
    cooldown_steps: int = field(default=50, metadata=_h("Steps before the same alert (kind, group) fires again."))

    def validate(self) -> list[str]:
        out = []
        if self.every_n_steps < 1:
            out.append(f"every_n_steps: got {self.every_n_steps}, must be >= 1")
        if self.vanishing_patience < 1:
            out.append(f"vanishing_patience: got {self.vanishing_patience}, must be >= 1")
        if not self.vanishing_norm < self.explosion_norm:
            out.append(f"vanishing_norm: got {self.vanishing_norm}, must be < explosion_norm ({self.explosion_norm})")
        return out


@dataclass
class NonFiniteConfig:
    """Non-finite locator: names the parameters (and optionally the op) behind a NaN/Inf gradient or loss."""

    enabled: bool = field(default=True, metadata=_h("Locate NaN/Inf gradients and losses."))
    rerun: bool = field(
        default=True,
        metadata=_h("Re-run the step's batches to name parameters when every gradient is already NaN (see docs)."),
    )
    detect_anomaly: bool = field(
        default=False, metadata=_h("During the re-run, use torch.autograd.detect_anomaly to name the op.")
    )
    max_reruns: int = field(default=3, metadata=_h("At most this many re-runs per training run (each costs a step)."))
    max_names: int = field(
        default=3,
        metadata=_h("How many parameter names the console line lists (+N more); the event's `params` keeps them all."),
    )
    cooldown_steps: int = field(default=50, metadata=_h("Steps before the same non-finite event fires again."))

    def validate(self) -> list[str]:
        return [f"max_reruns: got {self.max_reruns}, must be >= 0"] if self.max_reruns < 0 else []


@dataclass
class LossMonitorConfig:
    """Loss dynamics: spikes (robust z-score), rising curvature, eval-loss plateau (optional early stop)."""

    enabled: bool = field(default=True, metadata=_h("Track the per-step training loss and the eval loss."))
    spike_window: int = field(default=100, metadata=_h("Steps of history for the robust z-score."))
    spike_min_history: int = field(default=20, metadata=_h("No spike verdict before this many steps of history."))
    spike_zscore: float = field(
        default=6.0,
        metadata=_h(
            "Alert when the log of the step loss is this many robust sd (1.4826 MAD of the window's log losses) "
            "above their median ..."
        ),
    )
    spike_min_rel: float = field(
        default=0.5, metadata=_h("... and the loss at least this fraction above the window's median (both must hold).")
    )
    curvature_threshold: float = field(
        default=0.1, metadata=_h("Alert on l[i] - 2 l[i-1] + l[i-2] above this (while rising) ...")
    )
    curvature_patience: int = field(default=5, metadata=_h("... for this many consecutive checks."))
    curvature_interval: int = field(
        default=1, metadata=_h("Steps per curvature check; l[i] is the mean loss of the i-th interval.")
    )
    plateau_window: int = field(default=200, metadata=_h("Steps the eval loss must stay flat for a plateau."))
    plateau_delta: float = field(default=1e-3, metadata=_h("Flat means max - min eval loss below this."))
    plateau_early_stop: bool = field(default=True, metadata=_h("Stop training when the eval loss plateaus."))
    cooldown_steps: int = field(default=50, metadata=_h("Steps before the same alert fires again."))

    def validate(self) -> list[str]:
        out = []
        if self.spike_min_history < 3 or self.spike_min_history > self.spike_window:
            out.append(f"spike_min_history: got {self.spike_min_history}, must be in [3, spike_window]")
        for name in ("curvature_patience", "curvature_interval", "plateau_window"):
            if getattr(self, name) < 1:
                out.append(f"{name}: got {getattr(self, name)}, must be >= 1")
        return out


@dataclass
class UpdateMonitorConfig:
    """Update stall: relative update ||dtheta|| / ||theta|| per group near zero while gradients are not."""

    enabled: bool = field(default=True, metadata=_h("Measure relative parameter updates per group."))
    every_n_steps: int = field(default=20, metadata=_h("Measure every N steps (costs one copy of the trainables)."))
    stall_ratio: float = field(default=1e-9, metadata=_h("A relative update below this counts as stalled."))
    min_grad_norm: float = field(default=1e-8, metadata=_h("... if the group's grad norm is above this."))
    patience: int = field(default=3, metadata=_h("Consecutive stalled checks before alerting."))
    cooldown_steps: int = field(default=200, metadata=_h("Steps before the same group alerts again."))

    def validate(self) -> list[str]:
        return [f"every_n_steps: got {self.every_n_steps}, must be >= 1"] if self.every_n_steps < 1 else []


@dataclass
class MemoryMonitorConfig:
    """Memory: CUDA allocated / reserved / peak / fragmentation / retries / OOMs, process RSS, leak trend."""

    enabled: bool = field(default=True, metadata=_h("Sample memory at logging steps and every N steps."))
    every_n_steps: int = field(default=10, metadata=_h("Sample every N steps (also at every logging step)."))
    leak_window: int = field(default=10, metadata=_h("Samples in the leak-trend window."))
    leak_min_growth_gib: float = field(default=0.25, metadata=_h("Leak alert needs at least this much growth."))
    leak_rising_fraction: float = field(
        default=0.9, metadata=_h("... and this fraction of sample-to-sample changes rising.")
    )
    warmup_steps: int = field(default=20, metadata=_h("Ignore samples before this step (allocator warm-up)."))
    cooldown_steps: int = field(default=500, metadata=_h("Steps before the leak alert fires again."))

    def validate(self) -> list[str]:
        out = []
        if self.leak_window < 3:
            out.append(f"leak_window: got {self.leak_window}, must be >= 3")
        if not 0.5 <= self.leak_rising_fraction <= 1.0:
            out.append(f"leak_rising_fraction: got {self.leak_rising_fraction}, must be in [0.5, 1]")
        return out


@dataclass
class ThroughputMonitorConfig:
    """Throughput: tokens/s and time waiting for the dataloader vs computing."""

    enabled: bool = field(default=True, metadata=_h("Time steps and dataloader waits."))
    mild_ratio: float = field(default=1.2, metadata=_h("Data wait / compute above this: mild stall (warning)."))
    severe_ratio: float = field(default=2.5, metadata=_h("Data wait / compute above this: severe stall (error)."))
    min_steps: int = field(default=5, metadata=_h("Judge a stall over at least this many timed steps."))
    skip_first_steps: int = field(
        default=1, metadata=_h("Untimed warm-up steps at the start of training (a resume continues the count).")
    )
    cooldown_steps: int = field(default=200, metadata=_h("Steps before the stall alert fires again."))

    def validate(self) -> list[str]:
        ok = 0 < self.mild_ratio <= self.severe_ratio
        return [] if ok else [f"mild_ratio: got {self.mild_ratio}, must be > 0 and <= severe_ratio"]


@dataclass
class HardwareMonitorConfig:
    """GPU temperature, clocks, power and utilisation through NVML (the `nvml` extra); off elsewhere."""

    enabled: bool = field(default=True, metadata=_h("Read NVML at logging steps when a GPU and pynvml exist."))
    temp_alert_c: float = field(default=85.0, metadata=_h("Alert when the GPU temperature reaches this (C)."))
    cooldown_steps: int = field(default=500, metadata=_h("Steps before the temperature alert fires again."))


@dataclass
class ReplicaCheckConfig:
    """Replica consistency: where every rank holds the whole weights (DDP, ZeRO-1/2), their checksums must agree."""

    enabled: bool = field(
        default=True,
        metadata=_h("Compare a checksum of the trainable weights across ranks (at train start, on resume, every N)."),
    )
    interval: int = field(
        default=20,
        metadata=_h(
            "Check every N optimizer steps (one pass over the trainable weights and one small all-gather; "
            "benchmarks/replica_check.py: <= 0.5 % of the steps it covers at the default)."
        ),
    )

    def validate(self) -> list[str]:
        return [f"interval: got {self.interval}, must be >= 1"] if self.interval < 1 else []


@dataclass
class MonitorsConfig:
    """Read-only callbacks (gradient health, loss dynamics, memory, throughput, hardware).

    Each sub-section has its own `enabled` switch; `enabled` here switches all of them off.
    """

    enabled: bool = field(default=True, metadata={"help": "Master switch for every monitor."})
    grad: GradMonitorConfig = field(default_factory=GradMonitorConfig, metadata=_h("Gradient health."))
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig, metadata=_h("NaN/Inf locator."))
    loss: LossMonitorConfig = field(default_factory=LossMonitorConfig, metadata=_h("Loss dynamics."))
    update: UpdateMonitorConfig = field(default_factory=UpdateMonitorConfig, metadata=_h("Update stall."))
    memory: MemoryMonitorConfig = field(default_factory=MemoryMonitorConfig, metadata=_h("Memory."))
    throughput: ThroughputMonitorConfig = field(default_factory=ThroughputMonitorConfig, metadata=_h("Throughput."))
    hardware: HardwareMonitorConfig = field(default_factory=HardwareMonitorConfig, metadata=_h("NVML hardware."))
    replica_check: ReplicaCheckConfig = field(
        default_factory=ReplicaCheckConfig, metadata=_h("Weights identical on every data-parallel rank.")
    )


@dataclass
class StabilityConfig:
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
