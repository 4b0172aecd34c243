from hf_stable.optim.factory import build_optimizer, guarded_eps
from hf_stable.optim.fused_adamw import FusedAdamW
from hf_stable.optim.groups import param_groups, resolve_hyperparameters
from hf_stable.optim.handover import (
    OptimizerFactory,
    engine_builds_optimizer,
    trainer_optimizer_arguments,
    trainer_optimizer_factory,
)
from hf_stable.optim.phases import PhasedOptimizer, make_optimizer, unwrap_optimizer, wrap_for_phases
from hf_stable.optim.roles import ROLES, Role, classify, group_parameters, named_parameters_once, num_decoder_layers
from hf_stable.optim.scaling import rescale_lr
from hf_stable.optim.table import format_group_table, group_table, save_group_table

__all__ = [
    "ROLES",
    "FusedAdamW",
    "OptimizerFactory",
    "PhasedOptimizer",
    "Role",
    "build_optimizer",
    "classify",
    "engine_builds_optimizer",
    "format_group_table",
    "group_parameters",
    "group_table",
    "guarded_eps",
    "make_optimizer",
    "named_parameters_once",
    "num_decoder_layers",
    "param_groups",
    "rescale_lr",
    "resolve_hyperparameters",
    "save_group_table",
    "trainer_optimizer_arguments",
    "trainer_optimizer_factory",
    "unwrap_optimizer",
    "wrap_for_phases",
]
