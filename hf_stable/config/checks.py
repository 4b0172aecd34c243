"""Checks that need only the config, run when it is loaded: before a model, the data or an evaluation is touched.

Types, unknown keys and each section's own `validate()` are the loader's job. What is here crosses sections or
needs the installed packages, and would otherwise surface minutes later, after an 8B base is loaded, the data
tokenized and the "before" evaluation run: a batch size of 0 (a `ValueError` deep in the data audit), a
`training.report_to` integration that is not installed (the Trainer's `RuntimeError`), batch warmup without
`training.max_steps` (refused at train start), an LR the optimizer factory refuses, an engine (DeepSpeed) whose
package is missing (transformers' `PackageNotFoundError` traceback when TrainingArguments is built).

`load_config` raises them as one `ConfigError`; `hf-stable doctor` reports each as a blocking finding
(`hazards.config`), so both say the same thing from the same code.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from hf_stable.config.quantization import quantization_problems
from hf_stable.errors import ConfigError

# TrainingArguments keys that count things and must be >= 1 (0 or less fails late or trains nothing)
_AT_LEAST_ONE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
# step intervals: > 0 when set (a float < 1 is a fraction of the run)
_POSITIVE_INTERVALS = ("logging_steps", "save_steps", "eval_steps", "eval_accumulation_steps")


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def training_problems(training: dict, defaults: dict) -> list[str]:
    """Non-positive sizes, steps and intervals in the `training:` mapping (TrainingArguments accepts them)."""

    def get(key):
        return training.get(key, defaults.get(key))

    out = []
    for key in _AT_LEAST_ONE:
        value = _number(get(key))
        if value is not None and value < 1:
            out.append(f"training.{key}: got {value}, must be >= 1")
    for key in _POSITIVE_INTERVALS:
        value = _number(training.get(key))
        if value is not None and value <= 0:
            out.append(f"training.{key}: got {value}, must be > 0")
    max_steps, epochs = _number(get("max_steps")), _number(get("num_train_epochs"))
    if max_steps is not None and (max_steps == 0 or max_steps < -1):
        out.append(f"training.max_steps: got {max_steps}, must be > 0, or -1 to train training.num_train_epochs")
    elif max_steps is not None and max_steps < 0 and epochs is not None and epochs <= 0:
        out.append(f"training.num_train_epochs: got {epochs}, must be > 0 (or set training.max_steps > 0)")
    workers = _number(training.get("dataloader_num_workers"))
    if workers is not None and workers < 0:
        out.append(f"training.dataloader_num_workers: got {workers}, must be >= 0")
    return out


def reporting_problems(report_to) -> list[str]:
    """`training.report_to` names that transformers does not know or that are not installed."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    if report_to is None or report_to in ("all", "none", ["all"], ["none"]):
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    available = set(get_available_reporting_integrations())
    out = []
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            known = ", ".join(sorted(INTEGRATION_TO_CALLBACK))
            out.append(f"training.report_to: {name!r} is not an integration transformers knows ({known}, all, none)")
        elif name not in available:
            out.append(
                f"training.report_to: {name!r} is not installed: pip install {name}, or remove it (report_to: none)"
            )
    return out


def engine_problems(training: dict, env=None) -> list[str]:
    """A distribution engine the run is set up for whose package is not installed, with the extra that installs it."""
    from hf_stable.import_utils import is_deepspeed_available

    env = os.environ if env is None else env
    if is_deepspeed_available():
        return []
    fix = 'pip install "hf-stable[deepspeed]"'
    if training.get("deepspeed"):
        return [f"training.deepspeed: {training['deepspeed']!r} needs DeepSpeed, which is not installed: {fix}"]
    if str(env.get("ACCELERATE_USE_DEEPSPEED", "false")).lower() in ("1", "true"):
        return [f"the accelerate launch config uses DeepSpeed, which is not installed: {fix} (or launch without it)"]
    return []


def guard_problems(cfg, max_steps) -> list[str]:
    guards = cfg.stability.guards
    changing = [n for n in ("batch_warmup", "thermal") if guards.enabled and getattr(guards, n).enabled]
    if changing and not (max_steps is not None and max_steps > 0):
        names = " / ".join(f"stability.guards.{n}" for n in changing)
        what = f"{names} change gradient accumulation during the run and need a fixed number of optimizer steps"
        return [f"training.max_steps: got {max_steps}; {what}: set training.max_steps > 0"]
    return []


def optimizer_problems(cfg, training: dict, defaults: dict) -> list[str]:
    """What the optimizer factory would refuse: LR <= 0, weight decay < 0, an LLRD bottom above the LR, and
    (with `optim.fp16_eps_guard: error`) an fp16 Adam eps below `optim.fp16_eps_min`."""
    from hf_stable.optim.factory import guarded_eps
    from hf_stable.optim.groups import check_config, resolve_hyperparameters

    values = {k: training.get(k, defaults.get(k)) for k in defaults}
    values["fp16"] = bool(values.get("fp16")) or cfg.model.dtype == "float16"
    try:
        hp = resolve_hyperparameters(SimpleNamespace(**values))
        check_config(cfg.optim, hp)
        if cfg.optim.fp16_eps_guard == "error" and cfg.optim.name in ("adamw", "adamw_8bit", "paged_adamw_8bit"):
            guarded_eps(cfg.optim, hp)
    except ConfigError as e:
        return list(e.problems)
    except (TypeError, ValueError) as e:  # a value of the wrong type: the loader reports it already
        return [f"training: {e}"]
    return []


def config_problems(cfg) -> list[str]:
    """Every problem of a typed `RunConfig` that needs nothing but the config and the installed packages."""
    from hf_stable.config.training import training_defaults

    defaults = training_defaults()
    training = cfg.training
    problems = training_problems(training, defaults)
    problems += reporting_problems(training.get("report_to", defaults.get("report_to")))
    problems += guard_problems(cfg, _number(training.get("max_steps", defaults.get("max_steps"))))
    problems += optimizer_problems(cfg, training, {k: defaults.get(k) for k in _OPTIMIZER_KEYS})
    problems += quantization_problems(cfg)
    problems += engine_problems(training)
    if cfg.export.merged and not cfg.lora.enabled:
        problems.append(
            "export.merged: true with lora.enabled: false; a full fine-tune's output dir is already a standalone "
            "checkpoint (load it with from_pretrained): set export.merged: false"
        )
    return problems


_OPTIMIZER_KEYS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "fp16")


def check_config(cfg) -> None:
    """Raise one `ConfigError` listing `config_problems(cfg)`, if any.

    Raises:
        ConfigError: naming each key, the value and what is allowed.
    """
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(problems, source=cfg.source)
