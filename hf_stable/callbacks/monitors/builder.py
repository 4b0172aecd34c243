"""`build_monitors(cfg)`: the read-only stability monitors a `MonitorsConfig` asks for, in hook order.

How the recipe should configure `TrainingArguments` for them:

* `max_grad_norm=0` — the Trainer clips before any callback sees the gradients; with 0 the monitors read
  pre-clip gradients and an hf_stable guard does the clipping (per group). With `max_grad_norm > 0` the
  monitors still work but say once that their numbers are post-clip.
* `logging_nan_inf_filter=False` is *not* needed: the loss monitor reads the per-step loss from the model's
  forward output (unfiltered). Setting it anyway makes the Trainer's own `loss` column honest as well.
* `restore_callback_states_from_checkpoint` is not needed: hf_stable callbacks keep their state in
  `TrainerState.stateful_callbacks["hf_stable"]` and restore it themselves on resume.
* `logging_steps` decides how often metrics appear in the logs; alerts are judged every step regardless.

YAML (every key optional; defaults shown in docs/CONFIG.md):

    stability:
      monitors:
        grad: {explosion_norm: 1.0e4, vanishing_norm: 1.0e-6, max_abs: 1.0e3}
        nonfinite: {detect_anomaly: true}
        loss: {spike_zscore: 6.0, plateau_window: 200, plateau_early_stop: true}
        update: {every_n_steps: 20}
        replica_check: {interval: 20}
"""

from __future__ import annotations

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.monitors.gradient_monitor import GradientMonitor
from hf_stable.callbacks.monitors.hardware_monitor import HardwareMonitor
from hf_stable.callbacks.monitors.loss_monitor import LossMonitor
from hf_stable.callbacks.monitors.memory_monitor import MemoryMonitor
from hf_stable.callbacks.monitors.non_finite_locator import NonFiniteLocator
from hf_stable.callbacks.monitors.replica_check import ReplicaCheck
from hf_stable.callbacks.monitors.throughput_monitor import ThroughputMonitor
from hf_stable.callbacks.monitors.update_monitor import UpdateMonitor
from hf_stable.core.grad_stats import DeviceGradStats, GradReport, GradStats
from hf_stable.core.step_tap import StepTap

# Every event kind the monitors write (the report groups events by kind).
EVENT_KINDS = {
    "grad_explosion": "global grad norm above the explosion threshold",
    "grad_vanishing": "global grad norm below the vanishing threshold for N consecutive checks",
    "grad_max_abs": "one gradient element above the max |grad| threshold (group and parameter named)",
    "nonfinite_grad": "NaN/Inf gradients: the parameters, their groups and optionally the backward op",
    "nonfinite_loss": "the step's training loss is NaN/Inf",
    "loss_spike": "robust z-score of the step loss above the threshold",
    "loss_curvature": "loss rising with second difference above the threshold for N consecutive checks",
    "loss_plateau": "eval loss flat over the window (early stop when enabled)",
    "update_stall": "relative update ~0 while the group's gradient is not",
    "memory_leak": "CUDA reserved (or RSS) kept rising over the window",
    "alloc_retries": "the CUDA caching allocator had to free and retry",
    "oom": "CUDA out-of-memory errors were raised",
    "data_stall": "waiting for data longer than computing (mild / severe)",
    "gpu_hot": "GPU temperature at or above the alert threshold",
    "replica_mismatch": "the ranks' replicas of the trainable weights differ (ranks, first parameter); the run stops",
    "monitor_off": "a monitor cannot run here (e.g. no gradient to read)",
    "monitor_notice": "a caveat about the numbers (e.g. gradients are post-clip)",
    "recompile": "torch.compile compiled again after the warm-up (training.torch_compile; data.shape_buckets)",
}


def build_monitors(cfg) -> list[StabilityCallback]:
    """Instantiate the monitors enabled in `cfg` (a `MonitorsConfig`); empty when `cfg.enabled` is False.

    Example:
        >>> from hf_stable.config import MonitorsConfig
        >>> trainer = Trainer(..., callbacks=build_monitors(MonitorsConfig()))
    """
    if not cfg.enabled:
        return []
    sections = (
        (cfg.grad, GradientMonitor),
        (cfg.nonfinite, NonFiniteLocator),
        (cfg.loss, LossMonitor),
        (cfg.update, UpdateMonitor),
        (cfg.memory, MemoryMonitor),
        (cfg.throughput, ThroughputMonitor),
        (cfg.hardware, HardwareMonitor),
        (cfg.replica_check, ReplicaCheck),
    )
    return [cls(section) for section, cls in sections if section.enabled]


__all__ = [
    "EVENT_KINDS",
    "DeviceGradStats",
    "GradReport",
    "GradStats",
    "GradientMonitor",
    "HardwareMonitor",
    "LossMonitor",
    "MemoryMonitor",
    "NonFiniteLocator",
    "ReplicaCheck",
    "StepTap",
    "ThroughputMonitor",
    "UpdateMonitor",
    "build_monitors",
]
