"""hf_stable: stable and diagnosable LLM fine-tuning with the Hugging Face Trainer."""

from hf_stable.config import RunConfig, load_config
from hf_stable.errors import ConfigError, DataError, HfStableError, ModelError
from hf_stable.logging import optional_kernels_notice

# before anything imports peft (and with it bitsandbytes): its "pip install kernels" warning is for 4-bit on CPU only
optional_kernels_notice()

__version__ = "0.1.0"  # the one version source: pyproject.toml reads it (dynamic), the model card prints it

__all__ = [
    "ConfigError",
    "DataError",
    "HfStableError",
    "ModelError",
    "RunConfig",
    "__version__",
    "load_config",
    "stabilize",
]


def __getattr__(name: str):
    # `stabilize` imports transformers' Trainer: re-exported lazily, so `import hf_stable` stays light
    if name == "stabilize":
        from hf_stable.integrations.stabilize import stabilize

        return stabilize
    raise AttributeError(f"module 'hf_stable' has no attribute {name!r}")
