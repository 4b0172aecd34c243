"""The whole run's configuration: one YAML file → `RunConfig`.

Example:
    >>> cfg = load_config("configs/default.yaml", ["--training.learning_rate", "1e-4"])
    >>> cfg.training["learning_rate"]
    0.0001
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hf_stable.config.attention import AttentionConfig
from hf_stable.config.data import DataConfig
from hf_stable.config.doctor import DoctorConfig
from hf_stable.config.evaluation import EvaluationConfig
from hf_stable.config.export import ExportConfig
from hf_stable.config.loader import build_section, check_size, parse_overrides, read_yaml, set_dotted
from hf_stable.config.loss import TrainingLossConfig
from hf_stable.config.model import LoraSection, ModelConfig
from hf_stable.config.optim import OptimConfig
from hf_stable.config.runtime import RuntimeConfig
from hf_stable.config.stability import StabilityConfig
from hf_stable.config.stages import check_stages
from hf_stable.config.training import check_training, training_defaults  # noqa: F401 - re-exported (doctor)
from hf_stable.errors import ConfigError
from hf_stable.resources import package_file

DEFAULT_CONFIG = package_file("recipes", "default.yaml")  # `configs/default.yaml` in the checkout links to it


@dataclass
class RunConfig:
    """Every section of a recipe. `training` is passed through to `transformers.TrainingArguments`."""

    stage: Literal["sft", "dpo", "grpo"] = field(
        default="sft",
        metadata={
            "help": "What this run trains: 'sft' (supervised, the default), 'dpo' (preference pairs, TRL's "
            "DPOTrainer) or 'grpo' (prompts + rewards, TRL's GRPOTrainer); a later stage starts from "
            "model.start_from (docs/post-training.md)."
        },
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    export: ExportConfig = field(
        default_factory=ExportConfig,
        metadata={"help": "Reference recorded at the end of training; merged export (`hf-stable export`)."},
    )
    doctor: bool = field(default=False, metadata={"help": "Run `hf-stable doctor` checks before training."})
    doctor_checks: DoctorConfig = field(
        default_factory=DoctorConfig,
        metadata={"help": "Thresholds of `hf-stable doctor` (doctor: true runs it before training)."},
    )
    training_loss: TrainingLossConfig = field(
        default_factory=TrainingLossConfig,
        metadata={"help": "The training steps' loss: chunked LM head + cross-entropy, never the whole logits."},
    )
    training: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Keyword arguments of transformers.TrainingArguments."}
    )
    dpo: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "stage: dpo - trl.DPOConfig fields that TrainingArguments lacks (beta, loss_type, ...); "
            "shared fields stay under training, max_length is data.max_length."
        },
    )
    grpo: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "stage: grpo - trl.GRPOConfig fields that TrainingArguments lacks (num_generations, "
            "max_completion_length, beta, temperature, use_vllm, ...); shared fields stay under training."
        },
    )
    rewards: list[str] = field(
        default_factory=lambda: ["exact_answer", "answer_format"],
        metadata={
            "help": "stage: grpo - reward functions, summed (weights: grpo.reward_weights): shipped 'exact_answer', "
            "'answer_format', 'answer_similarity', or 'module:function' for your own."
        },
    )
    source: str | None = field(default=None, init=False, metadata={"help": "The YAML file this came from."})

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source", None)
        return out


def config_from_dict(data: dict, source: str | None = None) -> RunConfig:
    """Type-check `data` (a recipe mapping) into a `RunConfig`.

    Raises:
        ConfigError: every unknown key, wrong type and bad value at once; or a tree too large to read (aliases).
    """
    check_size(data, source or "config")
    problems: list[str] = []
    cfg = build_section(RunConfig, data, "", problems)
    if cfg is not None and not isinstance(cfg, RunConfig):
        cfg = None
    if cfg is not None:
        cfg.training = check_training(cfg.training, problems)
        check_stages(cfg, problems)
        cfg.source = source
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_recipe(path: Path, _seen: tuple = ()) -> dict:
    """Read a YAML recipe, resolving `extends: other.yaml` (relative to this file) by deep merge."""
    data = read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"extends: got {parent!r}, expected a YAML file path", source=str(path))
    parent_path = (path.parent / parent).resolve()
    if parent_path in _seen:
        raise ConfigError(f"extends: cycle through {parent_path}", source=str(path))
    if not parent_path.is_file():
        raise ConfigError(f"extends: {parent!r} not found (looked at {parent_path})", source=str(path))
    return _deep_merge(read_recipe(parent_path, (*_seen, parent_path)), data)


def load_config(path: str | Path | None = None, argv: list[str] | None = None, check: bool = True) -> RunConfig:
    """Load a YAML recipe (default: the packaged `configs/default.yaml`) and apply `--section.key value` overrides.

    Args:
        check: also run every check that needs only the config (`hf_stable.config.checks`): sizes and steps,
            `report_to` integrations installed, guards that need `max_steps`, optimizer values. The doctor
            passes False and reports them as findings instead.

    Raises:
        ConfigError: listing every unknown key, wrong type and bad value at once.
    """
    cli_path, overrides = parse_overrides(list(argv or []))
    path = Path(cli_path or path or DEFAULT_CONFIG)
    data = read_recipe(path.resolve() if path.exists() else path)
    for key, value in overrides:
        set_dotted(data, key, value)
    try:
        cfg = config_from_dict(data, source=str(path))
        if check:
            from hf_stable.config.checks import check_config

            check_config(cfg)
    except ConfigError as e:
        raise locate_overrides(e, [key for key, _ in overrides], path) from None
    return cfg


def _problem_key(problem: str) -> str:
    return problem.partition(": ")[0].strip()


def locate_overrides(error: ConfigError, keys: list[str], path: Path) -> ConfigError:
    """`error` with each problem that a command-line override caused said to come from the command line.

    Without it a typo in `--lora.rank 8` reads as a problem in the recipe file (often the packaged default.yaml,
    which the user never wrote). A problem is the override's when its key is the override's key or inside it.
    """
    if not keys:
        return error
    ours, marked = 0, []
    for problem in error.problems:
        key = _problem_key(problem)
        owner = next((k for k in keys if key == k or key.startswith((f"{k}.", f"{k}["))), None)
        if owner is None:
            marked.append(problem)
        else:
            ours += 1
            marked.append(f"{problem} [command-line argument --{owner}]")
    if not ours:
        return error
    where = "the command-line arguments"
    if ours == len(marked):  # all of them: the heading says where, the lines stay as they are
        return ConfigError(error.problems, source=where)
    return ConfigError(marked, source=f"{path} and {where}")


def training_arguments(cfg: RunConfig, **forced: Any):
    """Build `TrainingArguments` from `cfg.training` plus values the recipe must own.

    Raises:
        ConfigError: when TrainingArguments rejects a value; the message names the field.
    """
    from transformers import TrainingArguments

    kwargs = dict(cfg.training)
    kwargs.setdefault("output_dir", str(Path("outputs") / Path(cfg.source or "run").stem))
    kwargs.setdefault("ddp_find_unused_parameters", False)  # LoRA uses every trainable parameter
    kwargs.update(forced)
    try:
        return TrainingArguments(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"training: TrainingArguments rejected the values: {e}", source=cfg.source) from None
