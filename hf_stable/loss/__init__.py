from hf_stable.loss.chunked import ChunkedLoss, chunked_cross_entropy, shifted_labels
from hf_stable.loss.head import (
    ChunkedCausalLMOutput,
    ChunkedRun,
    causal_lm_of,
    chunked_training_forward,
    unsupported_reason,
)

__all__ = [
    "ChunkedCausalLMOutput",
    "ChunkedLoss",
    "ChunkedRun",
    "causal_lm_of",
    "chunked_cross_entropy",
    "chunked_training_forward",
    "shifted_labels",
    "unsupported_reason",
]
