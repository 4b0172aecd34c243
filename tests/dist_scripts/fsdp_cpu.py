"""TEST ONLY: let accelerate run FSDP2 on CPU ranks (gloo), so the stock Trainer path can be tested without GPUs.

accelerate turns an `fsdp_plugin` (from `TrainingArguments(fsdp=...)` or `ACCELERATE_USE_FSDP`) into
`DistributedType.FSDP` only for GPU-like distributed types (`accelerate/state.py`, `AcceleratorState.__init__`); a
CPU launch stays `MULTI_CPU` and silently trains as DDP. torch's `fully_shard` itself runs on CPU with gloo, so
this patch sets `distributed_type = FSDP` (and keeps the plugin) when the state came out `MULTI_CPU` with a plugin
given. Everything after that is accelerate's and the Trainer's own code: the plugin from the launch config's
environment or from `TrainingArguments.fsdp_config`, `cpu_ram_efficient_loading` (meta-device load on rank 1,
weights broadcast from rank 0), `fsdp2_prepare_model` (`fully_shard` per decoder layer from the auto-wrap policy,
then the root), the optimizer switched onto the DTensor shards, `clip_grad_norm_` over DTensors, the FSDP
state-dict gathering in `save_model` and checkpoints, and the FSDP checkpoint loading on resume.

Not exercised on CPU (only a GPU run does): NCCL, mixed-precision policies (`MixedPrecisionPolicy`, bf16 reduce),
CPU offload of parameters, FSDP activation checkpointing, and overlap of communication with compute.

Never imported by the package: `recipe_probe.py` applies it when a launch asks for FSDP.
"""

from __future__ import annotations

import functools


def patch_accelerator_state() -> None:
    """Make `AcceleratorState` honour an `fsdp_plugin` on `MULTI_CPU` (idempotent)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_hf_stable_fsdp_cpu", False):
        return
    original = AcceleratorState.__init__

    @functools.wraps(original)
    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # as accelerate does at the end of its own __init__: every later `AcceleratorState()` copies the
            # process state's type back in, and would otherwise turn the run into MULTI_CPU again (e.g. at save)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    __init__._hf_stable_fsdp_cpu = True
    AcceleratorState.__init__ = __init__
