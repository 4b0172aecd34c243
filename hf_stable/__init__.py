"""hf_stable: stable and diagnosable LLM fine-tuning with the Hugging Face Trainer."""

from hf_stable.config import RunConfig, load_config
from hf_stable.errors import ConfigError, DataError, HfStableError, ModelError

__version__ = "0.1.0"  # the one version source: pyproject.toml reads it (dynamic), the model card prints it

__all__ = ["ConfigError", "DataError", "HfStableError", "ModelError", "RunConfig", "__version__", "load_config"]
