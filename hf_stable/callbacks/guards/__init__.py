from hf_stable.callbacks.guards.accumulation_control import AccumulationControl
from hf_stable.callbacks.guards.batch_warmup_guard import BatchWarmupGuard
from hf_stable.callbacks.guards.builder import GUARD_EVENT_KINDS, build_guards, guard_training_overrides
from hf_stable.callbacks.guards.clip_guard import ClipGuard
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.callbacks.guards.optimizer_phase_guard import OptimizerPhaseGuard
from hf_stable.callbacks.guards.rollback_guard import RollbackGuard
from hf_stable.callbacks.guards.skip_guard import SkipGuard, StepVerdict
from hf_stable.callbacks.guards.snr_guard import SNRGuard
from hf_stable.callbacks.guards.thermal_guard import ThermalGuard

__all__ = [
    "GUARD_EVENT_KINDS",
    "AccumulationControl",
    "BatchWarmupGuard",
    "ClipGuard",
    "LRControl",
    "OptimizerPhaseGuard",
    "RollbackGuard",
    "SNRGuard",
    "SkipGuard",
    "StepVerdict",
    "ThermalGuard",
    "build_guards",
    "guard_training_overrides",
]
