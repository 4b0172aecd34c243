from hf_stable.callbacks.attention_monitor import AttentionMonitorCallback
from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.events import EVENTS_FILE, read_events, write_event
from hf_stable.callbacks.factory import build_callbacks
from hf_stable.callbacks.grad_monitor import GradientMonitor
from hf_stable.callbacks.grad_stats import DeviceGradStats, GradReport, GradStats
from hf_stable.callbacks.hardware_monitor import HardwareMonitor
from hf_stable.callbacks.loss_monitor import LossMonitor
from hf_stable.callbacks.memory_monitor import MemoryMonitor
from hf_stable.callbacks.monitors import EVENT_KINDS, build_monitors
from hf_stable.callbacks.nonfinite_locator import NonFiniteLocator
from hf_stable.callbacks.ordering import order_for_reporting
from hf_stable.callbacks.qk_clip import QKClipCallback
from hf_stable.callbacks.step_tap import StepTap
from hf_stable.callbacks.throughput_monitor import ThroughputMonitor
from hf_stable.callbacks.update_monitor import UpdateMonitor

__all__ = [
    "AttentionMonitorCallback",
    "DeviceGradStats",
    "EVENTS_FILE",
    "EVENT_KINDS",
    "GradReport",
    "GradStats",
    "GradientMonitor",
    "HardwareMonitor",
    "LossMonitor",
    "MemoryMonitor",
    "NonFiniteLocator",
    "QKClipCallback",
    "StabilityCallback",
    "StepTap",
    "ThroughputMonitor",
    "UpdateMonitor",
    "build_callbacks",
    "build_monitors",
    "order_for_reporting",
    "read_events",
    "write_event",
]
