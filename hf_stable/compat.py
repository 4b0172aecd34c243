"""Every private torch / transformers API hf_stable relies on, behind one door.

Private names change between releases without a deprecation. Each use goes through a function here, and
`tests/test_compat.py` exercises every one against the installed versions, so a version bump breaks this file's
test loudly instead of a guard quietly. Where a public API exists it is used instead (attention registration is
read through an `AttentionInterface()` instance, a public mapping).

The `Trainer` methods `StableTrainer` overrides (`_clip_grad_norm`, `_get_grad_norm`) cannot be called from here;
`TRAINER_METHODS` lists them with the signature we override, and the test checks it against `transformers.Trainer`.
"""

from __future__ import annotations

import operator
from collections import OrderedDict

import torch

# --- torch: foreach kernels (one kernel launch per device for a list of tensors) -----------------------------------


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2.0, dtype=torch.float32) -> list[torch.Tensor]:
    """Per-tensor `ord`-norms of `tensors` (all on one device), accumulated in `dtype`: `torch._foreach_norm`."""
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def foreach_mul_(tensors: list[torch.Tensor], factor: float | torch.Tensor | list[float]) -> None:
    """Multiply every tensor in place by `factor` (a number, a 0-d tensor on their device, or one number per
    tensor): `torch._foreach_mul_`."""
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


_VERSION = operator.attrgetter("_version")


def tensor_versions(tensors: list) -> list[int]:
    """`tensor_version` of each tensor, -1 for None (read every step for every gradient: one `map`, not a call each)."""
    try:
        return list(map(_VERSION, tensors))
    except AttributeError:  # a None among them
        return [-1 if t is None else t._version for t in tensors]


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


def fused_optimizer_device_types() -> tuple[str, ...]:
    """Device types torch's fused optimizer kernels run on (`torch.utils._foreach_utils`); ("cuda",) when torch
    does not say (CPU joined in torch 2.4)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ("cuda",)
    return tuple(_get_fused_kernels_supported_devices())


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


# TRL `DPOTrainer` methods the DPO stage overrides (`hf_stable.stages.dpo.PairsDPOTrainer`): name -> parameters.
TRL_DPO_METHODS = {"_prepare_dataset": ("self", "dataset", "processing_class", "args", "dataset_name")}

# Trainer methods `StableTrainer` overrides or calls: name -> parameter names (self first), as we call them.
TRAINER_METHODS = {
    "_clip_grad_norm": ("self", "model"),
    "_get_grad_norm": ("self", "model", "grad_norm"),
    "_has_mixed_mesh_grads": ("self", "model"),
    "_get_train_sampler": ("self", "train_dataset"),
    "_save_checkpoint": ("self", "model", "trial"),
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


def keep_train_column(trainer, name: str) -> None:
    """Make the Trainer's unused-column removal (`Trainer._remove_unused_columns`, ``remove_unused_columns=True``)
    keep the dataset column `name`: it is added to ``trainer._signature_columns``, which TRL's DPO / KTO trainers set
    in their `_set_signature_columns_if_needed` (the tokenized columns)."""
    trainer._set_signature_columns_if_needed()
    columns = list(trainer._signature_columns or [])
    if name not in columns:
        trainer._signature_columns = columns + [name]


# --- datasets: a filtered dataset's index mapping ------------------------------------------------------------------


def dataset_source_rows(dataset) -> list[int]:
    """For each row of a `datasets.Dataset`, its row in the table it was filtered / selected from: a ``filter`` (TRL
    drops over-long prompts after tokenizing) keeps the table and an index mapping (``Dataset._indices``);
    ``range(len)`` when there is none."""
    indices = getattr(dataset, "_indices", None)
    if indices is None:
        return list(range(len(dataset)))
    return [int(i) for i in indices.column(0).to_pylist()]


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


# --- DeepSpeed ZeRO: partitions between `engine.backward` and `engine.step` -----------------------------------------
# DeepSpeed's public accessors (`deepspeed.utils.safe_get_full_grad`, ...) all-reduce each parameter's gradient: one
# collective per tensor. Statistics need only this rank's part, which those accessors read through the attributes
# below (ZeRO-1/2: `param._hp_mapping`, ZeRO-3: `param.ds_id` / `param._z3_optimizer`).


def deepspeed_local_grad(param) -> torch.Tensor | None:
    """This rank's part of `param`'s reduced gradient, a live view (None when this rank holds none of it).

    ZeRO-1/2: the gradient fragment in ZeRO's partition (`_hp_mapping.get_lp_grad_fragment`, what
    `safe_get_full_grad` reads before its all-reduce); ZeRO-3: the gradient partition (`safe_get_local_grad`'s source,
    without its fp32 copy, so an in-place clip reaches the optimizer).
    """
    if hasattr(param, "ds_id"):
        if not param.requires_grad:
            return None
        grad, _ = param._z3_optimizer._get_fp32_grad_state_partition(param=param, release_swap_buffers=False)
        return grad
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        return mapping.get_lp_grad_fragment(param._index_in_param_group)
    except ValueError:  # "Gradients are only available immediately after backward and before engine step"
        return None


def deepspeed_local_param(param) -> torch.Tensor | None:
    """ZeRO-3: this rank's partition of `param`'s weights (`param.ds_tensor`); None for other parameters."""
    return getattr(param, "ds_tensor", None) if hasattr(param, "ds_id") else None


def deepspeed_device(param) -> torch.device:
    local = deepspeed_local_param(param)
    return (local if local is not None else param).device


def deepspeed_stage() -> int:
    """The ZeRO stage of this run's DeepSpeed config (accelerate's plugin); 2 when it cannot be read."""
    try:
        from accelerate.state import AcceleratorState

        plugin = AcceleratorState().deepspeed_plugin
        return int(plugin.zero_stage) if plugin is not None else 2
    except Exception:  # noqa: BLE001 - no accelerate state yet: the stage only names the engine
        return 2


def _loss_scaler(engine):
    return getattr(getattr(engine, "optimizer", None), "loss_scaler", None)


def deepspeed_loss_scaler_state(engine) -> dict | None:
    """The numbers of the ZeRO optimizer's loss scaler (`cur_scale`, `cur_iter`, `last_overflow_iter`, ...)."""
    scaler = _loss_scaler(engine)
    if scaler is None:
        return None
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool)) or v is None}


def restore_deepspeed_loss_scaler_state(engine, state: dict) -> None:
    scaler = _loss_scaler(engine)
    if scaler is not None:
        for k, v in state.items():
            setattr(scaler, k, v)


def deepspeed_master_partitions(optimizer) -> list[torch.Tensor] | None:
    """The flat fp32 partitions a ZeRO optimizer updates on this rank (the keys of its base optimizer's state), or
    None for any other optimizer. ZeRO-3 puts each one into its base optimizer's param groups only for the duration
    of that sub-group's step (`param_groups[i]["params"]` is empty otherwise), so the groups cannot be read instead.
    """
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):  # ZeRO-3, ZeRO-1/2
        flat = getattr(optimizer, name, None)
        if isinstance(flat, list) and (not flat or isinstance(flat[0], torch.Tensor)):
            return list(flat)
    return None


def deepspeed_clear_overflow(engine) -> None:
    """Clear the ZeRO optimizer's `overflow` flag after its step (it is reset at the start of every step anyway).
    accelerate's `optimizer_step_was_skipped` reads it, and the Trainer then holds its LR schedule back a step."""
    opt = getattr(engine, "optimizer", None)
    if opt is not None and hasattr(opt, "overflow"):
        opt.overflow = False


# --- torch: dynamo's compile counters (torch.compile) ---------------------------------------------------------------


def dynamo_compile_counts() -> dict[str, int]:
    """What torch.compile has done in this process since the last `reset_dynamo`: ``compiles`` (frames dynamo
    converted, recompilations included), ``recompiles`` (conversions of a frame it had converted before: a guard
    failed, e.g. a new input shape), ``graphs`` (FX graphs handed to the backend), ``graph_breaks`` and
    ``most_of_one`` (the most compilations of one function) and ``frames_at_limit`` (functions compiled
    ``torch._dynamo.config.recompile_limit`` times, which then run eagerly).

    Reads ``torch._dynamo.convert_frame.FRAME_COMPILE_COUNTER`` (compiles per frame) and
    ``torch._dynamo.utils.counters``; all zero when dynamo was never imported."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return {"compiles": 0, "recompiles": 0, "graphs": 0, "graph_breaks": 0, "most_of_one": 0, "frames_at_limit": 0}
    from torch._dynamo import config, convert_frame
    from torch._dynamo.utils import counters

    per_frame = [n for n in convert_frame.FRAME_COMPILE_COUNTER.values() if n > 0]
    return {
        "compiles": sum(per_frame),
        "recompiles": sum(n - 1 for n in per_frame),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "most_of_one": max(per_frame, default=0),
        "frames_at_limit": sum(1 for n in per_frame if n >= config.recompile_limit),
    }


def reset_dynamo() -> None:
    """Forget every compiled frame and zero the counters `dynamo_compile_counts` reads (``torch._dynamo.reset`` leaves
    ``torch._dynamo.utils.counters`` as they were)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
