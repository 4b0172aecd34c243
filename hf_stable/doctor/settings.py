"""The training values the checks read, resolved once from `TrainingArguments` or, failing that, the YAML.

The doctor must still report config hazards when `TrainingArguments` itself refuses the config (bf16 on a
machine without a GPU, say): then the values come from `cfg.training` with TrainingArguments' own defaults,
and the refusal is a finding of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hf_stable.config.doctor import DoctorConfig
from hf_stable.distributed import launch_world_size
from hf_stable.errors import ConfigError


@dataclass
class TrainingSettings:
    """The subset of TrainingArguments the doctor reasons about.

    Args:
        values: every TrainingArguments field (from the built arguments, or YAML over the defaults).
        explicit: keys the YAML sets (so a finding can say "you set" vs "the default is").
        args: the built `TrainingArguments`, or None when building them failed.
        error: why building them failed (a `ConfigError` message), else None.
        from_caller: the arguments were handed in (the recipe's, with its forced values) rather than built here.
    """

    values: dict[str, Any]
    explicit: set[str] = field(default_factory=set)
    args: Any = None
    error: str | None = None
    from_caller: bool = False

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key, default)
        return default if value is None else value

    @property
    def fp16(self) -> bool:
        return bool(self.get("fp16", False))

    @property
    def bf16(self) -> bool:
        return bool(self.get("bf16", False))

    @property
    def learning_rate(self) -> float:
        return float(self.get("learning_rate", 5e-5))

    @property
    def micro_batch(self) -> int:
        return int(self.get("per_device_train_batch_size", 8))

    @property
    def accumulation(self) -> int:
        return max(int(self.get("gradient_accumulation_steps", 1)), 1)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulation * launch_world_size()

    @property
    def gradient_checkpointing(self) -> bool:
        return bool(self.get("activation_checkpointing") or self.get("gradient_checkpointing"))

    @property
    def checkpointing_kwargs(self) -> dict | None:
        kw = self.values.get("activation_checkpointing_kwargs") or self.values.get("gradient_checkpointing_kwargs")
        return kw if isinstance(kw, dict) else None


def resolve_settings(cfg, args=None, **forced: Any) -> TrainingSettings:
    """Resolve the run's training values; never raises for a config TrainingArguments rejects.

    Args:
        cfg: the `RunConfig`.
        args: already built `TrainingArguments` (the recipe's), used as is.
        forced: values the recipe forces (e.g. ``remove_unused_columns=False``) when building them here.
    """
    from hf_stable.config import training_arguments
    from hf_stable.config.run import training_defaults

    explicit = set(cfg.training)
    from_caller = args is not None
    if args is None:
        try:
            args = training_arguments(cfg, **forced)
        except ConfigError as e:
            values = {**training_defaults(), **cfg.training, **forced}
            return TrainingSettings(values=values, explicit=explicit, args=None, error="; ".join(e.problems))
    values = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(args)}
    return TrainingSettings(values=values, explicit=explicit, args=args, from_caller=from_caller)


def doctor_settings(cfg, settings: DoctorConfig | None = None) -> DoctorConfig:
    """The doctor's own section: an explicit argument, else `cfg.doctor_checks` when RunConfig has it."""
    if settings is not None:
        return settings
    found = getattr(cfg, "doctor_checks", None)
    return found if isinstance(found, DoctorConfig) else DoctorConfig()
