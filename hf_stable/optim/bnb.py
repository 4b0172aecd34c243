"""bitsandbytes' 8-bit optimizers over the factory's groups: `optim.name: adamw_8bit | paged_adamw_8bit | lion_8bit`.

They keep each moment in 8-bit blocks (`state1`/`state2` uint8 with a 256-entry `qmap` and per-block `absmax`;
Dettmers et al., arXiv 2110.02861): AdamW's state shrinks from 8 to ~2 bytes per parameter. Tensors with fewer
than `optim.bnb_min_8bit_size` elements keep 32-bit state. The paged variant allocates its state in CUDA unified
memory, which the driver moves to host memory under pressure; on CPU there is nothing to page and bitsandbytes
falls back to ordinary tensors. The groups (LLRD, no-decay, LoRA+), betas, weight decay and the fp16 eps guard are
the ones `optimizer_over_groups` gives every optimizer.
"""

from __future__ import annotations

import warnings

import torch

from hf_stable.import_utils import require

# optim.name -> bitsandbytes.optim class name
BNB_OPTIMIZERS = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit", "lion_8bit": "Lion8bit"}


def bnb_optimizer(name: str, groups: list[dict], *, lr, betas, eps, weight_decay, min_8bit_size: int):
    """The bitsandbytes optimizer for `name` (a key of `BNB_OPTIMIZERS`) over ready groups.

    Raises:
        MissingDependencyError: bitsandbytes is not installed (with the pip line).
    """
    require("bitsandbytes", f"optim.name: {name}")
    import bitsandbytes as bnb

    cls = getattr(bnb.optim, BNB_OPTIMIZERS[name])
    kwargs = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "min_8bit_size": min_8bit_size}
    if name != "lion_8bit":
        kwargs["eps"] = eps
    with warnings.catch_warnings():
        # "paged optimizers are not supported on CPU, falling back": true, and said once in the docs instead
        warnings.filterwarnings("ignore", message=".*[Pp]aged.*")
        return cls(groups, **kwargs)


def is_bnb_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("bitsandbytes")


# state tensors per parameter, by optim.name and by class name (lower case)
STATE_TENSORS = {"adamw_8bit": 2, "paged_adamw_8bit": 2, "lion_8bit": 1}
_CLASS_TENSORS = {"adamw8bit": 2, "pagedadamw8bit": 2, "lion8bit": 1, "pagedlion8bit": 1, "adam8bit": 2}
_BLOCK = 256  # bitsandbytes' blockwise optimizer quantization: one fp32 absmax per 256 values, a 256-entry qmap


def state_bytes(numel: int, tensors: int, min_8bit_size: int = 4096) -> int:
    """Bytes of one parameter's 8-bit optimizer state: uint8 moments + absmax + qmap, or fp32 below the minimum."""
    if numel < min_8bit_size:
        return tensors * numel * 4
    return tensors * (numel + 4 * -(-numel // _BLOCK) + 4 * _BLOCK)


def predicted_state_bytes(optimizer) -> int | None:
    """The state a bitsandbytes optimizer will hold for its parameters (None for any other optimizer)."""
    tensors = _CLASS_TENSORS.get(type(optimizer).__name__.lower())
    if tensors is None or not is_bnb_optimizer(optimizer):
        return None
    minimum = int(getattr(getattr(optimizer, "args", None), "min_8bit_size", 4096))  # bitsandbytes keeps it there
    return sum(state_bytes(p.numel(), tensors, minimum) for g in optimizer.param_groups for p in g["params"])
