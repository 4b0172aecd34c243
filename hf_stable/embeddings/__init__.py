"""Embedding rows of the template tokens: find the untrained ones, repair or train them, carry the repair."""

from hf_stable.embeddings.repair import (
    MODES,
    REPAIR_FILE,
    apply_repair,
    handle_untrained_tokens,
    read_repair,
    repair_markdown,
    repair_rows,
    save_repair,
    trainable_token_indices,
)
from hf_stable.embeddings.untrained import (
    FlaggedRow,
    UntrainedTokens,
    embedding_matrices,
    find_untrained_tokens,
    special_token_ids,
    used_special_tokens,
)

__all__ = [
    "MODES",
    "REPAIR_FILE",
    "FlaggedRow",
    "UntrainedTokens",
    "apply_repair",
    "embedding_matrices",
    "find_untrained_tokens",
    "handle_untrained_tokens",
    "read_repair",
    "repair_markdown",
    "repair_rows",
    "save_repair",
    "special_token_ids",
    "trainable_token_indices",
    "used_special_tokens",
]
