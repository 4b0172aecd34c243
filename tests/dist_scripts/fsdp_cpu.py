"""Test-only: FSDP2 through accelerate and the stock `Trainer` on CPU ranks (gloo). Never used by the package.

accelerate's `AcceleratorState` turns an `fsdp_plugin` into `DistributedType.FSDP` only for GPU-like distributed
types (`accelerate/state.py`); on CPU it stays `MULTI_CPU` and the run silently becomes DDP. torch's `fully_shard`
itself runs on CPU with gloo, so `enable()` wraps `AcceleratorState.__init__` to switch a `MULTI_CPU` state that
was given an `fsdp_plugin` to `FSDP` (and the process state with it, as accelerate's own `__init__` does: every later
`AcceleratorState()` copies the process state's type back in, and saving would otherwise meet MULTI_CPU again).
Everything after that decision is accelerate's and the Trainer's own path: the plugin from a launch config's
environment (`accelerate launch --config_file configs/accelerate/fsdp2.yaml`) or from `TrainingArguments.fsdp_config`,
`cpu_ram_efficient_loading` (meta-device load on the other ranks, weights broadcast from rank 0), `fully_shard` per
decoder layer and the root (accelerate's `fsdp2_prepare_model`), DTensor parameters, gradients and optimizer state
sharded on dim 0, the Trainer's `on_pre_optimizer_step` between backward and `optimizer.step`, the optimizer built
from `create_optimizer` / `optimizer_cls_and_kwargs` and moved onto the shards, FULL_STATE_DICT saving, FSDP
checkpoints and their loading on resume.
What only a GPU run exercises: NCCL collectives and streams, FSDP2 mixed precision (`MixedPrecisionPolicy`, bf16
params with fp32 reduce), CPU offload of parameters, FSDP activation checkpointing, overlap of communication with
compute.
"""

from __future__ import annotations


def enable() -> None:
    from accelerate import state as accelerate_state
    from accelerate.utils import DistributedType

    cls = accelerate_state.AcceleratorState
    if getattr(cls.__init__, "_hf_stable_fsdp_cpu", False):
        return
    original = cls.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            accelerate_state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    __init__._hf_stable_fsdp_cpu = True
    cls.__init__ = __init__
