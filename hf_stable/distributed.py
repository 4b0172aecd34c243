"""Collectives that let every rank take the same decision, and are no-ops in a single process.

A guard or a preemption handler that decides on one rank only deadlocks the others (they wait in the
next collective of a step the first rank skipped) or silently diverges the replicas. So every decision
that changes training goes through one of these helpers first: each rank contributes its local view
and all ranks get the same answer back.

All helpers work before `torch.distributed` is initialised and without it (they return the local
value), on gloo (CPU) and on NCCL (the tensor is put on the current CUDA device, as NCCL requires).

Example:
    >>> stop = all_reduce_flag(self._signal_received)     # True on every rank if any rank got SIGTERM
    >>> worst = all_reduce_scalar(local_grad_norm, "max")
"""

from __future__ import annotations

import os
from typing import Any, Literal

ReduceOp = Literal["sum", "max", "min", "mean"]


def is_distributed() -> bool:
    """True when a torch.distributed process group with more than one rank is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def sharded_training(args) -> str | None:
    """Why gradients/parameters are sharded across ranks here (DeepSpeed ZeRO or FSDP), or None.

    Then `p.grad` is None (ZeRO keeps gradients in its own buffers) or a per-rank shard (FSDP), and per-tensor
    statistics or skip decisions read from it would be wrong or differ per rank: monitors and guards say they are off.
    Set by TrainingArguments (`deepspeed=`, `fsdp=`) or by `accelerate launch` (environment).
    """
    env = os.environ
    if getattr(args, "deepspeed", None) or env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true"):
        return "DeepSpeed keeps gradients in its own (partitioned) buffers; p.grad is None"
    if getattr(args, "fsdp", None) or env.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return "FSDP shards gradients and parameters across ranks; per-tensor statistics would be per shard"
    return None


def _collective_device():
    """NCCL only reduces CUDA tensors; gloo (and ccl) take CPU tensors."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_scalar(value: float, op: ReduceOp = "sum") -> float:
    """Reduce one float across ranks (`sum`, `max`, `min` or `mean`); the local value when not distributed.

    The reduction runs in float64 so a sum of step counts or a max of norms is exact for every value a
    float64 holds (NaN propagates through `sum`/`mean`; `max`/`min` follow torch's NaN rules).

    Raises:
        ValueError: `op` is not one of the four names.
    """
    if op not in ("sum", "max", "min", "mean"):
        raise ValueError(f"op: got {op!r}, must be one of 'sum', 'max', 'min', 'mean'")
    if not is_distributed():
        return float(value)
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    reduce_op = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    dist.all_reduce(tensor, op=reduce_op[op])
    out = float(tensor.item())
    return out / dist.get_world_size() if op == "mean" else out


def all_reduce_flag(flag: bool, require: Literal["any", "all"] = "any") -> bool:
    """True on every rank when `flag` holds on any rank (`require="any"`) or on all ranks (`"all"`)."""
    if not is_distributed():
        return bool(flag)
    return all_reduce_scalar(1.0 if flag else 0.0, "max" if require == "any" else "min") > 0.5


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (picklable objects); `obj` itself when not distributed.

    Used for decisions that read the file system (which checkpoint to resume from): with node-local disks
    the ranks could see different files, so the main process decides and the others follow.
    """
    if not is_distributed():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank; nothing when not distributed.

    A one-element all-reduce rather than `dist.barrier()`, which on NCCL warns without a device id and may
    guess the wrong device.
    """
    if is_distributed():
        all_reduce_scalar(0.0, "sum")


def prepare_launch(args) -> None:
    """Check and finish the process-group setup right after `TrainingArguments` is built.

    * Fails fast when the launcher started several processes but TrainingArguments runs each one alone. On a
      machine without GPUs, `torchrun` / `accelerate launch --multi_gpu` start N processes and a gloo group,
      but unless `use_cpu` is set TrainingArguments picks `ParallelMode.NOT_PARALLEL`: every process trains
      on all the data, believes it is the main process and writes the same files — silently.
    * Warns that `fp16` on CPU is plain fp32 (accelerate makes no GradScaler and no fp16 autocast there).
    * With `use_cpu` and a DeepSpeed config, TrainingArguments sets up torch.distributed but not DeepSpeed's
      communication layer, so ZeRO-3's `zero.Init` (used by `from_pretrained`) sees a world of 1 and rejects
      the batch size. Wrapping the existing group fixes that; on GPUs accelerate has already done it.

    Raises:
        ConfigError: `WORLD_SIZE` > 1 but `args.world_size` differs; the message says how to fix it.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size != launched:
        from hf_stable.errors import ConfigError

        hint = (
            "this machine has no GPU: set --training.use_cpu true (the gloo backend is then used)"
            if not _cuda_available()
            else "check that the launcher and TrainingArguments agree (see configs/accelerate/README.md)"
        )
        raise ConfigError(
            f"training.use_cpu: the launcher started {launched} processes (WORLD_SIZE={launched}) but "
            f"TrainingArguments runs each one alone (parallel_mode {args.parallel_mode.value}), so every process "
            f"would train on all the data and write the same files; {hint}"
        )
    if getattr(args, "fp16", False) and str(getattr(args, "device", "")).startswith("cpu"):
        from hf_stable.logging import get_logger

        get_logger(__name__).warning(
            "training.fp16 on CPU trains in plain fp32: accelerate uses neither fp16 autocast nor a GradScaler on "
            "CPU; use training.bf16 for reduced precision on CPU"
        )
    if getattr(args, "deepspeed", None) and is_distributed():
        import deepspeed
        import torch.distributed as dist

        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend=dist.get_backend())


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def shutdown() -> None:
    """End of a distributed run: wait for every rank, then tear the process group down (no-op otherwise).

    Without it the main process, which writes the report and model card, exits seconds after the others;
    a gloo rank whose peer has already gone can abort (SIGABRT) while the interpreter shuts down, turning a
    finished run into a failed job.
    """
    if not is_distributed():
        return
    import torch.distributed as dist

    barrier()
    dist.destroy_process_group()
