from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.builder import build_callbacks
from hf_stable.callbacks.guards.qk_clip_callback import QKClipCallback
from hf_stable.callbacks.monitors import EVENT_KINDS, build_monitors
from hf_stable.callbacks.monitors.attention_monitor_callback import AttentionMonitorCallback
from hf_stable.callbacks.monitors.gradient_monitor import GradientMonitor
from hf_stable.callbacks.monitors.hardware_monitor import HardwareMonitor
from hf_stable.callbacks.monitors.loss_monitor import LossMonitor
from hf_stable.callbacks.monitors.memory_monitor import MemoryMonitor
from hf_stable.callbacks.monitors.non_finite_locator import NonFiniteLocator
from hf_stable.callbacks.monitors.replica_check import ReplicaCheck
from hf_stable.callbacks.monitors.throughput_monitor import ThroughputMonitor
from hf_stable.callbacks.monitors.update_monitor import UpdateMonitor
from hf_stable.callbacks.ordering import order_for_reporting

__all__ = [
    "EVENT_KINDS",
    "AttentionMonitorCallback",
    "GradientMonitor",
    "HardwareMonitor",
    "LossMonitor",
    "MemoryMonitor",
    "NonFiniteLocator",
    "QKClipCallback",
    "ReplicaCheck",
    "StabilityCallback",
    "ThroughputMonitor",
    "UpdateMonitor",
    "build_callbacks",
    "build_monitors",
    "order_for_reporting",
]
