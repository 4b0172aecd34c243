from hf_stable.reporting.outputs import finalize_outputs, optimizer_markdown

__all__ = ["finalize_outputs", "optimizer_markdown"]
