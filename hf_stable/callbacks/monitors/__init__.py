from hf_stable.callbacks.monitors.attention_monitor_callback import AttentionMonitorCallback
from hf_stable.callbacks.monitors.builder import EVENT_KINDS, build_monitors
from hf_stable.callbacks.monitors.compile_monitor import CompileMonitor
from hf_stable.callbacks.monitors.gradient_monitor import GradientMonitor
from hf_stable.callbacks.monitors.hardware_monitor import HardwareMonitor
from hf_stable.callbacks.monitors.loss_monitor import LossMonitor
from hf_stable.callbacks.monitors.memory_monitor import MemoryMonitor
from hf_stable.callbacks.monitors.non_finite_locator import NonFiniteLocator
from hf_stable.callbacks.monitors.replica_check import ReplicaCheck, ReplicaMismatchError
from hf_stable.callbacks.monitors.throughput_monitor import ThroughputMonitor
from hf_stable.callbacks.monitors.update_monitor import UpdateMonitor

__all__ = [
    "EVENT_KINDS",
    "AttentionMonitorCallback",
    "CompileMonitor",
    "GradientMonitor",
    "HardwareMonitor",
    "LossMonitor",
    "MemoryMonitor",
    "NonFiniteLocator",
    "ReplicaCheck",
    "ReplicaMismatchError",
    "ThroughputMonitor",
    "UpdateMonitor",
    "build_monitors",
]
