"""Optimizer parameter groups: one LR and weight decay per role and depth.

Why groups rather than one LR: fine-tuning moves the bottom of a pretrained model less than its top (layer-wise
LR decay), LoRA's B factor learns best with a larger LR than A (LoRA+), and decaying embeddings, norms or biases
towards zero only hurts. The LR ladder, for L decoder layers and base LR `lr` (= training.learning_rate):

    decoder layer i   lr * d^(L-1-i)                    (top layer: lr)
    embeddings        lr * d^L * embedding_lr_multiplier (one step below layer 0)
    final norm        lr
    lm_head           lr * lm_head_lr_multiplier
    other             lr
    LoRA B (+ LoRA embedding B)   ratio * the LR of its site (LoRA+, composes with the ladder)

with d = optim.llrd_decay, or d = (llrd_lr_bottom / lr)^(1/L) when an explicit bottom LR is given (the embeddings
then get exactly llrd_lr_bottom). Weight decay is 0 for embeddings, biases, norms and DoRA magnitudes,
`optim.lora_weight_decay` (default: training.weight_decay) for LoRA factors, training.weight_decay elsewhere.

The Trainer's scheduler (LambdaLR) scales every group's own `initial_lr`, so the ladder keeps its shape under
warmup/decay. The group holding the base LR is put first, because the Trainer logs `learning_rate` from group 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_stable.config.optim import OptimConfig
from hf_stable.errors import ConfigError, ModelError
from hf_stable.optim.roles import Role, classify, named_parameters_once, num_decoder_layers

_NO_DECAY_ROLES = ("embeddings", "bias", "norm", "dora_magnitude")
_LORA_ROLES = ("lora_A", "lora_B", "lora_embedding")


@dataclass(frozen=True)
class BaseHyperparameters:
    """The hyperparameters the factory takes from `training:` (TrainingArguments), resolved once."""

    lr: float
    weight_decay: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    fp16: bool = False
    lr_key: str = "training.learning_rate"
    weight_decay_key: str = "training.weight_decay"


def resolve_hyperparameters(args=None, **overrides) -> BaseHyperparameters:
    """Read LR, weight decay, Adam betas/eps and fp16 from `args` (TrainingArguments); keywords override.

    Raises:
        ConfigError: when the LR is missing or <= 0, or the weight decay is < 0.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    values = {}
    if args is not None:
        values = {
            "lr": args.learning_rate,
            "weight_decay": args.weight_decay,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
            "fp16": bool(getattr(args, "fp16", False)),
        }
    values.update(overrides)
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    lr_key = "lr" if "lr" in overrides or args is None else "training.learning_rate"
    wd_key = "weight_decay" if "weight_decay" in overrides or args is None else "training.weight_decay"
    values.setdefault("weight_decay", 0.0)
    problems = []
    if "lr" not in values:
        problems.append("lr: missing; pass TrainingArguments (training.learning_rate) or lr=...")
    elif not values["lr"] > 0:
        problems.append(f"{lr_key}: got {values['lr']}, must be > 0")
    if not values["weight_decay"] >= 0:
        problems.append(f"{wd_key}: got {values['weight_decay']}, must be >= 0")
    if problems:
        raise ConfigError(problems)
    return BaseHyperparameters(**values, lr_key=lr_key, weight_decay_key=wd_key)


def check_config(cfg: OptimConfig, hp: BaseHyperparameters) -> None:
    """Raise one ConfigError with every problem of `cfg`, including those that need the base LR."""
    problems = [f"optim.{p}" for p in cfg.validate()]
    if cfg.llrd_lr_bottom is not None and cfg.llrd_lr_bottom > hp.lr:
        problems.append(
            f"optim.llrd_lr_bottom: got {cfg.llrd_lr_bottom}, must be <= {hp.lr_key} ({hp.lr}): the bottom of the "
            "ladder cannot be above its top"
        )
    if problems:
        raise ConfigError(problems)


def depth_decay(cfg: OptimConfig, lr: float, num_layers: int) -> float:
    """The per-layer decay factor d of the LR ladder (see the module docstring)."""
    if cfg.llrd_lr_bottom is None or num_layers == 0:
        return cfg.llrd_decay
    return (cfg.llrd_lr_bottom / lr) ** (1.0 / num_layers)


def lr_multiplier(role: Role, cfg: OptimConfig, decay: float, num_layers: int) -> float:
    """Factor on the base LR for a parameter of `role`."""
    if role.site == "layer":
        factor = decay ** max(num_layers - 1 - role.layer, 0)
    elif role.site == "embeddings":
        factor = decay**num_layers * cfg.embedding_lr_multiplier
    elif role.site == "lm_head":
        factor = cfg.lm_head_lr_multiplier
    else:
        factor = 1.0
    if role.lora_side == "B":
        factor *= cfg.lora_plus_ratio
    return factor


def weight_decay_for(role: Role, cfg: OptimConfig, weight_decay: float) -> float:
    if role.role in _NO_DECAY_ROLES:
        return 0.0
    if role.role in _LORA_ROLES and cfg.lora_weight_decay is not None:
        return cfg.lora_weight_decay
    return weight_decay


def _group_name(role: Role) -> str:
    # Norms and biases share their layer's report group but not its weight decay, so they get their own
    # optimizer group; the final norm is already a group of its own.
    if role.role in ("bias", "norm") and role.group != "norm":
        return f"{role.group}.no_decay"
    return role.group


def param_groups(
    model: torch.nn.Module,
    cfg: OptimConfig | None = None,
    args=None,
    *,
    lr: float | None = None,
    weight_decay: float | None = None,
) -> list[dict]:
    """Split the trainable parameters of `model` into optimizer groups by role and depth.

    Args:
        model: a (PEFT-wrapped or plain) causal LM; only `requires_grad` parameters are grouped.
        cfg: the `optim:` section (defaults: `OptimConfig()`).
        args: `transformers.TrainingArguments`, the source of the base LR and weight decay.
        lr, weight_decay: explicit values for users without TrainingArguments (they win over `args`).

    Returns:
        A list of dicts with `name`, `params`, `param_names`, `lr`, `weight_decay`, `role`, `layer`; every
        trainable tensor is in exactly one group (tied weights once).

    Raises:
        ConfigError: bad `cfg` values, LR <= 0, weight decay < 0.
        ModelError: the model has no trainable parameters.

    Example:
        >>> groups = param_groups(peft_model, OptimConfig(llrd_decay=0.8), training_args)
        >>> [(g["name"], g["lr"]) for g in groups][:2]
        [('layer_1.lora_A', 0.0002), ('layer_0.lora_A', 0.00016)]
    """
    cfg = cfg or OptimConfig()
    hp = resolve_hyperparameters(args, lr=lr, weight_decay=weight_decay)
    check_config(cfg, hp)
    num_layers = num_decoder_layers(model)
    decay = depth_decay(cfg, hp.lr, num_layers)

    groups: dict[str, dict] = {}
    for name, param in named_parameters_once(model, trainable_only=True):
        role = classify(name)
        key = _group_name(role)
        if key not in groups:
            groups[key] = {
                "name": key,
                "params": [],
                "param_names": [],
                "lr": hp.lr * lr_multiplier(role, cfg, decay, num_layers),
                "weight_decay": weight_decay_for(role, cfg, hp.weight_decay),
                "role": role.role,
                "layer": role.layer,
            }
        groups[key]["params"].append(param)
        groups[key]["param_names"].append(name)

    out = list(groups.values())
    _check_complete(model, out)
    first = next((i for i, g in enumerate(out) if g["lr"] == hp.lr), 0)
    out.insert(0, out.pop(first))
    return out


def _check_complete(model: torch.nn.Module, groups: list[dict]) -> None:
    trainable = {id(p): n for n, p in named_parameters_once(model, trainable_only=True)}
    if not trainable:
        raise ModelError(
            "the model has no trainable parameters: nothing to optimize. Attach a LoRA adapter (peft) or "
            "set requires_grad=True on the weights to train."
        )
    grouped = [id(p) for g in groups for p in g["params"]]
    missed = sorted(trainable[i] for i in set(trainable) - set(grouped))
    doubled = len(grouped) != len(set(grouped))
    if missed or doubled:  # a bug in the grouping, never the user's fault: say exactly what went wrong
        raise ModelError(
            f"optimizer grouping is inconsistent: {len(missed)} trainable parameter(s) in no group "
            f"(first: {missed[:3]}), duplicates: {doubled}. Please report this with the model's architecture."
        )
