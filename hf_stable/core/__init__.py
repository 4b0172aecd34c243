"""The machinery under the callbacks, the trainer, the doctor and the report: one pass over the gradients per step
(`grad_stats`), the step's batch and loss (`step_tap`), stability events (`events`), rank agreement, weight
snapshots for rollback."""

from hf_stable.core.events import EVENTS_FILE, read_events, write_event
from hf_stable.core.grad_report import DeviceGradStats, GradReport
from hf_stable.core.grad_stats import GradStats
from hf_stable.core.rank_agreement import GuardOrderError, drop_gradients
from hf_stable.core.step_tap import StepTap

__all__ = [
    "EVENTS_FILE",
    "DeviceGradStats",
    "GradReport",
    "GradStats",
    "GuardOrderError",
    "StepTap",
    "drop_gradients",
    "read_events",
    "write_event",
]
