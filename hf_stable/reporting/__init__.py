from hf_stable.reporting.generation_config import generation_config, save_generation_config
from hf_stable.reporting.outputs import finalize_outputs, optimizer_markdown

__all__ = ["finalize_outputs", "generation_config", "optimizer_markdown", "save_generation_config"]
