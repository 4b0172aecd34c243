from hf_stable.callbacks.guards.accumulation import AccumulationControl
from hf_stable.callbacks.guards.batch_warmup import BatchWarmupGuard
from hf_stable.callbacks.guards.builder import GUARD_EVENT_KINDS, build_guards, guard_training_overrides
from hf_stable.callbacks.guards.clipping import ClipGuard
from hf_stable.callbacks.guards.distributed import GuardOrderError, drop_gradients
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.callbacks.guards.optimizer_phases import OptimizerPhaseGuard, PhasedOptimizer, wrap_for_phases
from hf_stable.callbacks.guards.rollback import RollbackGuard
from hf_stable.callbacks.guards.skip_step import SkipGuard, StepVerdict
from hf_stable.callbacks.guards.snr_lr import SNRGuard
from hf_stable.callbacks.guards.thermal import ThermalGuard

__all__ = [
    "GUARD_EVENT_KINDS",
    "AccumulationControl",
    "BatchWarmupGuard",
    "OptimizerPhaseGuard",
    "PhasedOptimizer",
    "SNRGuard",
    "ThermalGuard",
    "wrap_for_phases",
    "build_guards",
    "guard_training_overrides",
    "ClipGuard",
    "GuardOrderError",
    "LRControl",
    "RollbackGuard",
    "SkipGuard",
    "StepVerdict",
    "drop_gradients",
]
