from hf_stable.config.attention import AttentionConfig
from hf_stable.config.data import DataConfig
from hf_stable.config.evaluation import EvaluationConfig
from hf_stable.config.model import EmbeddedBaseConfig, LoraSection, ModelConfig
from hf_stable.config.optim import OptimConfig
from hf_stable.config.run import DEFAULT_CONFIG, RunConfig, config_from_dict, load_config, training_arguments
from hf_stable.config.runtime import RuntimeConfig
from hf_stable.config.stability import GuardsConfig, MonitorsConfig, StabilityConfig

__all__ = [
    "DEFAULT_CONFIG",
    "AttentionConfig",
    "DataConfig",
    "EmbeddedBaseConfig",
    "EvaluationConfig",
    "GuardsConfig",
    "LoraSection",
    "ModelConfig",
    "MonitorsConfig",
    "OptimConfig",
    "RunConfig",
    "RuntimeConfig",
    "StabilityConfig",
    "config_from_dict",
    "load_config",
    "training_arguments",
]
