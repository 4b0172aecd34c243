"""Config section for the optimizer factory (param groups, layer-wise LR, LoRA+).

The base learning rate, weight decay and Adam betas/eps live in `training:` (TrainingArguments);
this section only holds what the factory adds on top, so no hyperparameter lives in two places.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class OptimConfig:
    """Which optimizer the factory builds and how it splits parameters into groups."""

    name: Literal["adamw", "lion", "sgd"] = field(default="adamw", metadata={"help": "Optimizer."})
    llrd_decay: float = field(
        default=0.9, metadata={"help": "Layer-wise LR decay: layer i gets lr * decay^(L-1-i). 1.0 = off."}
    )
    lora_plus_ratio: float = field(default=16.0, metadata={"help": "LoRA+: lr_B = ratio * lr_A. 1.0 = off."})

    def validate(self) -> list[str]:
        problems = []
        if not 0.0 < self.llrd_decay <= 1.0:
            problems.append(f"llrd_decay: got {self.llrd_decay}, must be in (0, 1]")
        if self.lora_plus_ratio <= 0:
            problems.append(f"lora_plus_ratio: got {self.lora_plus_ratio}, must be > 0")
        return problems
