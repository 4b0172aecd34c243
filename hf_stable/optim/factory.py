"""Build the optimizer (AdamW, Lion, SGD, bitsandbytes' 8-bit ones) over `param_groups`, with the fp16 eps guard.

How the result reaches the Trainer (a prebuilt optimizer, or a factory under FSDP and DeepSpeed) is
`optim.handover`'s.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from hf_stable.config.optim import OptimConfig
from hf_stable.errors import ConfigError
from hf_stable.optim.bnb import BNB_OPTIMIZERS, bnb_optimizer
from hf_stable.optim.fused_adamw import FusedAdamW
from hf_stable.optim.groups import BaseHyperparameters, check_config, param_groups, resolve_hyperparameters


def guarded_eps(cfg: OptimConfig, hp: BaseHyperparameters) -> float:
    """AdamW eps after the fp16 guard.

    eps 1e-8 is not representable in fp16 (smallest subnormal ~6e-8), so `sqrt(v) + eps` no longer protects the
    division when the optimizer state is half precision (fp16 weights). Under AMP (`training.fp16` with fp32
    master weights) the state is fp32 and 1e-8 is harmless; the guard still applies there because it costs
    nothing measurable and protects runs that later move to pure fp16 weights. `optim.fp16_eps_guard: off`
    disables it.

    Raises:
        ConfigError: when `optim.fp16_eps_guard` is "error" and the eps is too small.
    """
    if not hp.fp16 or cfg.fp16_eps_guard == "off" or hp.eps >= cfg.fp16_eps_min:
        return hp.eps
    what = f"training.adam_epsilon: got {hp.eps}, below optim.fp16_eps_min ({cfg.fp16_eps_min}) under fp16"
    if cfg.fp16_eps_guard == "error":
        raise ConfigError(f"{what}; set training.adam_epsilon >= {cfg.fp16_eps_min} or optim.fp16_eps_guard: clamp")
    if cfg.fp16_eps_guard == "warn":
        warnings.warn(f"{what}; keeping it (optim.fp16_eps_guard: warn)", stacklevel=4)
        return hp.eps
    warnings.warn(f"{what}; using eps={cfg.fp16_eps_min} (optim.fp16_eps_guard: clamp)", stacklevel=4)
    return cfg.fp16_eps_min


def adamw_kernel(cfg: OptimConfig, groups: list[dict]) -> dict:
    """The AdamW kernel keyword for `groups`: `{"fused": True}`, `{"foreach": True}` or `{"foreach": False}`.

    auto: fused (one kernel per device and dtype for every group's update, and no host sync under a GradScaler)
    when every parameter is a floating-point tensor on a device type torch has fused kernels for (CPU since torch
    2.4, CUDA) and, when CUDA is available, CUDA is one too (the Trainer moves the model there after we build;
    parameters keep their identity when moved); foreach otherwise (per-device multi-tensor kernels).
    """
    if cfg.adamw_impl == "fused":
        return {"fused": True}
    if cfg.adamw_impl == "foreach":
        return {"foreach": True}
    if cfg.adamw_impl == "for_loop":
        return {"foreach": False}
    from hf_stable.compat import fused_optimizer_device_types

    supported = fused_optimizer_device_types()
    params = [p for g in groups for p in g["params"]]
    devices = {p.device.type for p in params} | ({"cuda"} if torch.cuda.is_available() else set())
    if all(p.is_floating_point() for p in params) and devices <= set(supported):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimConfig | None = None,
    args=None,
    *,
    lr: float | None = None,
    weight_decay: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    fp16: bool | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer named by `cfg.name` over `param_groups(model, cfg, args)`.

    Args:
        model: the model to train (PEFT-wrapped or plain).
        cfg: the `optim:` section (defaults: `OptimConfig()`).
        args: `transformers.TrainingArguments`: learning_rate, weight_decay, adam_beta1/2, adam_epsilon, fp16.
        lr, weight_decay, betas, eps, fp16: explicit values for users without TrainingArguments (win over `args`).

    Raises:
        ConfigError: every bad value at once (LR <= 0, decay outside (0, 1], ratio <= 0, fp16 eps with guard "error").

    Example:
        >>> optimizer = build_optimizer(model, OptimConfig(name="adamw"), training_args)
        >>> trainer = Trainer(model=model, args=training_args, optimizers=(optimizer, None), ...)
    """
    cfg = cfg or OptimConfig()
    hp = resolve_hyperparameters(args, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fp16=fp16)
    check_config(cfg, hp)
    groups = param_groups(model, cfg, lr=hp.lr, weight_decay=hp.weight_decay)
    return optimizer_over_groups(cfg.name, groups, cfg, hp, key="optim.name")


def optimizer_over_groups(
    name: str, groups: list[dict], cfg: OptimConfig | None, hp: BaseHyperparameters, key: str = "optim.name"
) -> torch.optim.Optimizer:
    """The one place an optimizer is constructed: `name` over ready groups (each with its own lr/weight_decay).

    `build_optimizer` and the phased optimizer's switches both come here, so betas, the fp16 eps guard, the AdamW
    kernel choice, Lion betas and SGD momentum are the same whichever optimizer a run starts or switches to.

    Raises:
        ConfigError: an unknown `name` (named by `key`), or an fp16 eps below the minimum with guard "error".
    """
    cfg = cfg or OptimConfig()
    if any(p.dtype == torch.float16 for g in groups for p in g["params"]):  # pure fp16 weights: the real danger
        hp = dataclasses.replace(hp, fp16=True)

    if name == "adamw":
        kernel = adamw_kernel(cfg, groups)
        # fused: torch's kernel, every group stepped in one pass (`optim.fused_adamw`, bit for bit torch's AdamW)
        cls = FusedAdamW if kernel.get("fused") else torch.optim.AdamW
        return cls(groups, lr=hp.lr, betas=hp.betas, eps=guarded_eps(cfg, hp), weight_decay=hp.weight_decay, **kernel)
    if name == "lion":
        from lion_pytorch import Lion

        # lion-pytorch's decay is `p *= 1 - lr * wd`, i.e. decoupled and scaled by each group's LR like AdamW's.
        return Lion(groups, lr=hp.lr, betas=tuple(cfg.lion_betas), weight_decay=hp.weight_decay)
    if name == "sgd":
        # SGD's weight_decay is L2 (added to the gradient): the same as decoupled decay for plain SGD, close to it
        # with momentum.
        return torch.optim.SGD(
            groups,
            lr=hp.lr,
            momentum=cfg.sgd_momentum,
            nesterov=cfg.sgd_nesterov and cfg.sgd_momentum > 0,
            weight_decay=hp.weight_decay,
        )
    if name in BNB_OPTIMIZERS:
        betas = hp.betas if name != "lion_8bit" else tuple(cfg.lion_betas)
        eps = guarded_eps(cfg, hp) if name != "lion_8bit" else hp.eps
        return bnb_optimizer(
            name,
            groups,
            lr=hp.lr,
            betas=betas,
            eps=eps,
            weight_decay=hp.weight_decay,
            min_8bit_size=cfg.bnb_min_8bit_size,
        )
    allowed = ", ".join(repr(n) for n in ("adamw", "lion", "sgd", *BNB_OPTIMIZERS))
    raise ConfigError(f"{key}: got {name!r}, allowed: {allowed}")
