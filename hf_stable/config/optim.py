"""Config section for the optimizer factory (param groups, layer-wise LR, LoRA+).

The base learning rate, weight decay and Adam betas/eps live in `training:` (TrainingArguments);
this section only holds what the factory adds on top, so no hyperparameter lives in two places.
In particular the top of the layer-wise LR ladder is always `training.learning_rate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class OptimConfig:
    """Which optimizer the factory builds and how it splits parameters into groups.

    Example:
        >>> OptimConfig(name="adamw", llrd_decay=0.9, lora_plus_ratio=16.0).validate()
        []
    """

    name: Literal["adamw", "lion", "sgd", "adamw_8bit", "paged_adamw_8bit", "lion_8bit"] = field(
        default="adamw",
        metadata={
            "help": "Optimizer. The *_8bit ones are bitsandbytes' (AdamW8bit, PagedAdamW8bit, Lion8bit: state in "
            "8-bit blocks; paged state moves to host memory under GPU memory pressure); they need the "
            "bitsandbytes extra."
        },
    )
    llrd_decay: float = field(
        default=0.9,
        metadata={
            "help": "Layer-wise LR decay: decoder layer i of L gets lr * decay^(L-1-i), embeddings lr * decay^L "
            "(one step below layer 0). 1.0 = off. Ignored when llrd_lr_bottom is set."
        },
    )
    llrd_lr_bottom: float | None = field(
        default=None,
        metadata={
            "help": "Explicit layer-wise LR instead of llrd_decay: the embeddings get this LR, the top decoder "
            "layer gets training.learning_rate, layers in between are interpolated geometrically. "
            "Must be > 0 and <= training.learning_rate."
        },
    )
    embedding_lr_multiplier: float = field(
        default=1.0,
        metadata={"help": "Extra factor on the embeddings' LR, on top of their place below layer 0 in the ladder."},
    )
    lm_head_lr_multiplier: float = field(
        default=1.0,
        metadata={"help": "lm_head LR = training.learning_rate * this (the head sits above the decoder stack)."},
    )
    lora_plus_ratio: float = field(
        default=16.0,
        metadata={"help": "LoRA+: lr_B = ratio * lr_A at the same depth (also LoRA embedding B). 1.0 = off."},
    )
    lora_weight_decay: float | None = field(
        default=None,
        metadata={
            "help": "Weight decay for LoRA A/B factors. null = training.weight_decay. "
            "(Embeddings, biases, norms and DoRA magnitudes always get 0.)"
        },
    )
    adamw_impl: Literal["auto", "fused", "foreach", "for_loop"] = field(
        default="auto",
        metadata={
            "help": "AdamW kernel: auto = torch's fused AdamW where it runs on the parameters' devices (CPU with "
            "PyTorch >= 2.4, CUDA), else foreach; fused/foreach/for_loop force one."
        },
    )
    sgd_momentum: float = field(default=0.9, metadata={"help": "SGD momentum."})
    sgd_nesterov: bool = field(default=True, metadata={"help": "SGD Nesterov momentum (needs momentum > 0)."})
    lion_betas: list[float] = field(
        default_factory=lambda: [0.9, 0.99],
        metadata={"help": "Lion (beta1, beta2). Lion usually wants a 3-10x smaller LR than AdamW."},
    )
    bnb_min_8bit_size: int = field(
        default=4096,
        metadata={
            "help": "*_8bit optimizers: tensors with fewer elements keep 32-bit state (bitsandbytes' "
            "min_8bit_size; 8-bit blocks do not pay off on small tensors)."
        },
    )
    fp16_eps_min: float = field(
        default=1e-6,
        metadata={"help": "Smallest AdamW eps allowed under fp16 (1e-8 is below fp16 resolution)."},
    )
    fp16_eps_guard: Literal["clamp", "warn", "error", "off"] = field(
        default="clamp",
        metadata={
            "help": "When training.fp16 is on and adam_epsilon < fp16_eps_min: clamp = raise eps to the minimum "
            "and warn; warn = warn only; error = ConfigError; off = do nothing."
        },
    )

    def validate(self) -> list[str]:
        problems = []
        if not 0.0 < self.llrd_decay <= 1.0:
            problems.append(f"llrd_decay: got {self.llrd_decay}, must be in (0, 1]")
        if self.llrd_lr_bottom is not None and not self.llrd_lr_bottom > 0:
            problems.append(f"llrd_lr_bottom: got {self.llrd_lr_bottom}, must be > 0 (or null to use llrd_decay)")
        for key in ("embedding_lr_multiplier", "lm_head_lr_multiplier", "lora_plus_ratio", "fp16_eps_min"):
            value = getattr(self, key)
            if not value > 0:
                problems.append(f"{key}: got {value}, must be > 0")
        if self.lora_weight_decay is not None and not self.lora_weight_decay >= 0:
            problems.append(f"lora_weight_decay: got {self.lora_weight_decay}, must be >= 0 (or null)")
        if self.bnb_min_8bit_size < 0:
            problems.append(f"bnb_min_8bit_size: got {self.bnb_min_8bit_size}, must be >= 0")
        if not 0.0 <= self.sgd_momentum < 1.0:
            problems.append(f"sgd_momentum: got {self.sgd_momentum}, must be in [0, 1)")
        if self.sgd_nesterov and self.name == "sgd" and self.sgd_momentum == 0:
            problems.append("sgd_nesterov: got true with sgd_momentum 0, Nesterov needs momentum > 0")
        if len(self.lion_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.lion_betas):
            problems.append(f"lion_betas: got {self.lion_betas}, must be two numbers in [0, 1)")
        return problems
