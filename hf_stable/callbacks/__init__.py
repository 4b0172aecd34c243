from hf_stable.callbacks.attention_monitor import AttentionMonitorCallback
from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.events import EVENTS_FILE, read_events, write_event
from hf_stable.callbacks.factory import build_callbacks
from hf_stable.callbacks.qk_clip import QKClipCallback

__all__ = [
    "AttentionMonitorCallback",
    "QKClipCallback","StabilityCallback", "EVENTS_FILE", "read_events", "write_event", "build_callbacks"]
