"""Adapters for trainers hf_stable does not own (TRL's), and `stabilize(trainer)`, the one line that attaches
hf_stable to any `Trainer` subclass. Nothing here imports TRL."""

from hf_stable.integrations.trainer_families import TrainerFamily, family_of

__all__ = ["TrainerFamily", "family_of"]
