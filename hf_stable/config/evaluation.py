"""Config section for the before/after evaluation the recipe runs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvaluationConfig:
    """Eval loss and greedy exact-match on held-out prompts, before and after training."""

    before: bool = field(default=True, metadata={"help": "Evaluate the base model before training."})
    exact_match_samples: int = field(
        default=200, metadata={"help": "Held-out prompts scored by greedy exact match (0 = off)."}
    )
    max_new_tokens: int = field(default=32, metadata={"help": "Generation budget per exact-match prompt."})
    generation_batch_size: int = field(default=64, metadata={"help": "Prompts generated together."})

    def validate(self) -> list[str]:
        problems = []
        if self.exact_match_samples < 0:
            problems.append(f"exact_match_samples: got {self.exact_match_samples}, must be >= 0")
        if self.max_new_tokens <= 0:
            problems.append(f"max_new_tokens: got {self.max_new_tokens}, must be > 0")
        if self.generation_batch_size <= 0:
            problems.append(f"generation_batch_size: got {self.generation_batch_size}, must be > 0")
        return problems
