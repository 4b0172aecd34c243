"""Config section for the attention implementation."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AttentionConfig:
    """Which attention implementation the model uses."""

    implementation: str = field(
        default="sdpa", metadata={"help": "'hf_stable', or any transformers implementation (sdpa, eager, ...)."}
    )
