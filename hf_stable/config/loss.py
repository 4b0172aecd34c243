"""Config section for the training loss: the chunked LM head + cross-entropy that never holds the whole logits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainingLossConfig:
    """How training steps compute the causal-LM loss (evaluation and predictions always use the model's forward)."""

    chunked: bool = field(
        default=True,
        metadata={
            "help": "Training steps run the model body to hidden states, then the LM head and cross-entropy over "
            "chunks of the supervised positions only, recomputing each chunk's logits in the backward: the "
            "[tokens, vocab] logits are never held (hf_stable.loss). Same loss and gradients as the model's own "
            "forward; false = the model's forward. Models it does not fit (logit scaling, MoE router loss, a "
            "custom loss_type), and a trainable lm_head (LoRA / modules_to_save) under ZeRO-3 or FSDP2, keep the "
            "model's forward."
        },
    )
    chunk_size: int = field(
        default=1024,
        metadata={"help": "Supervised tokens per chunk: the logits held at once are chunk_size x vocab (fp32)."},
    )
    z_loss: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the z-loss (PaLM, arXiv 2204.02311): z_loss x log(sum exp(logits))^2 per supervised "
            "token, normalised like the cross-entropy and included in the logged loss; 1e-4 is usual, 0 = off."
        },
    )

    def validate(self) -> list[str]:
        problems = []
        if self.chunk_size <= 0:
            problems.append(f"chunk_size: got {self.chunk_size}, must be > 0")
        if self.z_loss < 0:
            problems.append(f"z_loss: got {self.z_loss}, must be >= 0")
        return problems
