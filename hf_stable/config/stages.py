"""The recipe's training stage (`stage: sft | dpo | grpo`) and the `dpo:` / `grpo:` sections.

A stage section takes TRL's own field names (`trl.DPOConfig` / `trl.GRPOConfig`), the way `training:` takes
TrainingArguments'. Both TRL configs subclass TrainingArguments; the fields they share stay under `training:` (one
place for the learning rate, batch size, schedule), and TRL's `max_length` is refused where the recipe's
`data.max_length` already says how long a sequence may be. TRL is imported only when a stage section is checked or
built, so `stage: sft` runs without it.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from hf_stable.config.loader import did_you_mean
from hf_stable.config.training import coerce_field
from hf_stable.errors import ConfigError, MissingDependencyError

STAGES = ("sft", "dpo", "grpo")
TRL_STAGES = ("dpo", "grpo")
TRL_INSTALL = "pip install 'hf_stable[trl]'"
# keys a stage section may not hold although TRL's config has them: {key: where the recipe says it instead}
_OWNED_BY_RECIPE = {
    "max_length": "data.max_length",
    "model_init_kwargs": "model.* (model.dtype, model.quantization, model.trust_remote_code)",
    "trust_remote_code": "model.trust_remote_code",
}


# TrainingArguments fields whose default TRL's configs change, kept at TrainingArguments' default unless set
# (gradient_checkpointing None: `activation_checkpointing`, the current name, decides, off by default)
_TRAINING_DEFAULTS = {"bf16": False, "gradient_checkpointing": None}


def require_trl(stage: str):
    """Import and return `trl`, or raise a one-line `MissingDependencyError` naming the extra to install."""
    try:
        import trl
    except ImportError:
        raise MissingDependencyError(f"stage: {stage} needs TRL, which is not installed: {TRL_INSTALL}") from None
    return trl


def trl_config_class(stage: str):
    """`trl.DPOConfig` or `trl.GRPOConfig` for `stage` (TRL imported here)."""
    trl = require_trl(stage)
    return {"dpo": trl.DPOConfig, "grpo": trl.GRPOConfig}[stage]


def _stage_field_types(stage: str) -> dict[str, Any]:
    cls = trl_config_class(stage)
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _training_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


def check_stage_section(stage: str, section: dict, problems: list[str]) -> dict:
    """`section` (the `dpo:` or `grpo:` mapping) checked against TRL's config for `stage`: unknown keys with a
    did-you-mean, TrainingArguments fields sent to `training.*`, keys the recipe owns sent to their place; numbers
    written as strings coerced. Returns the checked mapping."""
    if not section:
        return {}
    try:
        types_ = _stage_field_types(stage)
    except MissingDependencyError as e:
        problems.append(f"{stage}: {e}")
        return dict(section)
    training = _training_fields()
    name = trl_config_class(stage).__name__
    out = {}
    for key, value in section.items():
        where = f"{stage}.{key}"
        if key in _OWNED_BY_RECIPE:
            problems.append(f"{where}: set by the recipe, use {_OWNED_BY_RECIPE[key]} instead")
            continue
        if key in training:
            problems.append(f"{where}: a TrainingArguments field, set it as training.{key} (every stage reads it)")
            continue
        if key not in types_:
            close = [c for c in did_you_mean(key, types_) if c not in training and c not in _OWNED_BY_RECIPE]
            close += [f"training.{c}" for c in did_you_mean(key, training)][: 3 - len(close)]
            hint = f" (did you mean {', '.join(close)}?)" if close else f" (see trl.{name})"
            problems.append(f"{where}: not a trl.{name} field{hint}")
            continue
        out[key] = coerce_field(value, types_[key], where, problems)
    return out


def check_stages(cfg, problems: list[str]) -> None:
    """Cross-section stage rules, run by `config_from_dict`: each TRL section checked against its dataclass (only
    when it has keys or its stage runs), a section for another stage flagged, `model.start_from` only for a stage
    that continues an earlier one."""
    for stage in TRL_STAGES:
        section = getattr(cfg, stage)
        if section and cfg.stage != stage:
            problems.append(f"{stage}: set but stage is {cfg.stage!r}; set stage: {stage} or remove the section")
            continue
        if cfg.stage == stage and not section:
            try:
                require_trl(stage)
            except MissingDependencyError as e:
                problems.append(str(e))
            continue
        setattr(cfg, stage, check_stage_section(stage, section, problems))
    if cfg.stage == "grpo":
        from hf_stable.rewards import SHIPPED

        for name in cfg.rewards:
            if ":" not in name and name not in SHIPPED:
                close = did_you_mean(name, SHIPPED)
                hint = f"did you mean {' or '.join(close)}? " if close else ""
                problems.append(
                    f"rewards: unknown reward {name!r} ({hint}shipped: {', '.join(SHIPPED)}; yours: 'module:function')"
                )
        if not cfg.rewards:
            problems.append("rewards: empty; name at least one (e.g. exact_answer)")
    if cfg.model.start_from is not None and cfg.stage == "sft":
        problems.append(
            "model.start_from: only for stage dpo or grpo (a later stage continues the SFT run's adapter); "
            "for SFT set model.name_or_path"
        )


def stage_arguments(cfg, **forced: Any):
    """`trl.DPOConfig` / `trl.GRPOConfig` from `training:` + the stage's section + values the recipe owns
    (`forced`), the stage counterpart of `training_arguments`. DPO's `max_length` is `data.max_length`. `bf16` and
    activation checkpointing not set under `training:` keep TrainingArguments' defaults (off), as in the SFT stage,
    where TRL's configs turn both on.

    Raises:
        ConfigError: when TRL's config rejects the values; the message names the stage.
        MissingDependencyError: TRL is not installed.
    """
    cls = trl_config_class(cfg.stage)
    kwargs = dict(cfg.training)
    kwargs.update(getattr(cfg, cfg.stage))
    kwargs.setdefault("output_dir", str(Path("outputs") / Path(cfg.source or "run").stem))
    kwargs.setdefault("ddp_find_unused_parameters", False)
    for key, value in _TRAINING_DEFAULTS.items():  # TRL's: bf16 on (fails on CPU), checkpointing on
        kwargs.setdefault(key, value)
    if cfg.stage == "dpo":
        kwargs["max_length"] = cfg.data.max_length
    kwargs.update(forced)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{cfg.stage}: trl.{cls.__name__} rejected the values: {e}", source=cfg.source) from None
