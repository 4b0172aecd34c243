from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.events import EVENTS_FILE, read_events, write_event
from hf_stable.callbacks.factory import build_callbacks

__all__ = ["StabilityCallback", "EVENTS_FILE", "read_events", "write_event", "build_callbacks"]
