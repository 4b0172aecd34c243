"""The recipe's `training:` section: keyword arguments of `transformers.TrainingArguments`, checked against its
fields (unknown keys, numbers written as strings) and completed by its defaults."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from hf_stable.config.loader import coerce, did_you_mean


def training_defaults() -> dict[str, Any]:
    """Every TrainingArguments field's default value (what a key missing from `training:` means)."""
    from transformers import TrainingArguments

    out = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _training_field_types() -> dict[str, Any]:
    from transformers import TrainingArguments

    hints = typing.get_type_hints(TrainingArguments)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(TrainingArguments) if f.init}


def check_training(training: dict, problems: list[str]) -> dict:
    """Unknown TrainingArguments keys are problems; numbers written as `1e-4` are coerced to float."""
    types_ = _training_field_types()
    out = {}
    for key, value in training.items():
        if key not in types_:
            close = did_you_mean(key, types_)
            hint = f" (did you mean {', '.join(close)}?)" if close else " (see transformers.TrainingArguments)"
            problems.append(f"training.{key}: not a TrainingArguments field{hint}")
            continue
        out[key] = coerce_field(value, types_[key], f"training.{key}", problems)
    return out


def coerce_field(value, tp, where: str, problems: list[str]):
    """`value` for a dataclass field of type `tp`: a YAML scalar (`1e-4`, `"3"`, `2.0` for an int) coerced to
    float / int / bool, a problem appended when it cannot be; other types pass through."""
    if tp not in (float, int, bool):
        return value
    sub: list[str] = []
    coerced = coerce(value, tp, where, sub)
    if sub and tp is int and isinstance(value, float) and value.is_integer():
        coerced, sub = int(value), []
    problems.extend(sub)
    return value if sub else coerced
