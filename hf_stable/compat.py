"""Every private torch / transformers API hf_stable relies on, behind one door.

Private names change between releases without a deprecation. Each use goes through a function here, and
`tests/test_compat.py` exercises every one against the installed versions, so a version bump breaks this file's
test loudly instead of a guard quietly. Where a public API exists it is used instead (attention registration is
read through an `AttentionInterface()` instance, a public mapping).

The `Trainer` methods `StableTrainer` overrides (`_clip_grad_norm`, `_get_grad_norm`) cannot be called from here;
`TRAINER_METHODS` lists them with the signature we override, and the test checks it against `transformers.Trainer`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

# --- torch: foreach kernels (one kernel launch per device for a list of tensors) -----------------------------------


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2.0, dtype=torch.float32) -> list[torch.Tensor]:
    """Per-tensor `ord`-norms of `tensors` (all on one device), accumulated in `dtype`: `torch._foreach_norm`."""
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def foreach_mul_(tensors: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply every tensor in place by `factor` (a number or a 0-d tensor on their device): `torch._foreach_mul_`."""
    torch._foreach_mul_(tensors, factor)


def foreach_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one foreach call (`torch._foreach_mul(tensors, 1.0)`)."""
    return list(torch._foreach_mul(tensors, 1.0))


def foreach_sub(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """`[x - y for x, y in zip(a, b)]` in one foreach call: `torch._foreach_sub`."""
    return list(torch._foreach_sub(a, b))


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter (`Tensor._version`), bumped by every in-place operation on it."""
    return tensor._version


# --- torch: the optimizer and loss-scaler internals -----------------------------------------------------------------

# The hook registries `torch.optim.Optimizer.__init__` creates; an optimizer that does not call it (the phased
# optimizer, whose groups and state belong to an inner optimizer) creates them itself.
OPTIMIZER_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give `optimizer` the empty hook registries `Optimizer.__init__` would have made."""
    for name in OPTIMIZER_HOOK_DICTS:
        setattr(optimizer, name, OrderedDict())


def scaler_unscale_once(scaler, optimizer: torch.optim.Optimizer) -> bool:
    """Unscale `optimizer`'s gradients unless `scaler` already did this step; True when it found inf/NaN.

    `GradScaler.unscale_` raises when called twice in a step, and whether it ran is only in the scaler's private
    per-optimizer state (`_per_optimizer_states`, `OptState`).
    """
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    return any(v.item() > 0 for v in state["found_inf_per_device"].values())


# --- transformers ---------------------------------------------------------------------------------------------------


def attn_implementation(model_or_config) -> str | None:
    """The attention implementation a model runs (`config._attn_implementation`); None when there is no config."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "_attn_implementation", None)


# Trainer methods `StableTrainer` overrides or calls: name -> parameter names (self first), as we call them.
TRAINER_METHODS = {
    "_clip_grad_norm": ("self", "model"),
    "_get_grad_norm": ("self", "model", "grad_norm"),
    "_has_mixed_mesh_grads": ("self", "model"),
    "_get_train_sampler": ("self", "train_dataset"),
    "_init_training_state": (
        "self",
        "max_steps",
        "num_update_steps_per_epoch",
        "num_train_epochs",
        "resume_from_checkpoint",
        "trial",
    ),
}


def has_mixed_mesh_grads(trainer, model) -> bool:
    """Whether gradients live on different device meshes (`Trainer._has_mixed_mesh_grads`)."""
    return trainer._has_mixed_mesh_grads(model)


# --- bitsandbytes: the CPU inference repack of 4-bit weights --------------------------------------------------------


def keep_cpu_4bit_layout(model: torch.nn.Module) -> int:
    """Stop bitsandbytes' `Linear4bit` from repacking its weight for CPU inference (its `support_avx512bf16_for_cpu`
    attribute); returns how many layers were changed.

    On a CPU with AVX512-BF16 the first eval-mode forward without grad rewrites the frozen 4-bit weight in place into
    another layout, so the evaluation before training changes the weights training then starts from and a re-run in
    eval mode takes another kernel than the step it checks; it also fails outright when a layer's input size is not a
    multiple of the quantization block (64: the embedded base's MLP width 352).
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed
