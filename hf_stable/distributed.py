"""Every collective hf_stable runs, behind one door: each rank takes the same decision, and a run ends cleanly.

The rule, for every caller in the package: **a collective is entered by every rank at the same point, and the
decision to enter it is rank-agreed** - configuration, the step number, or values that came out of an earlier
collective. Never a per-rank cache, an alert cooldown or a local fault (a NaN on this rank only): one rank in a
collective the other skipped aborts gloo ("collective mismatch") and hangs NCCL. When a local condition must
decide, reduce it first (`all_reduce_flag`) or make the collective unconditional. Nothing outside this module
calls `torch.distributed` collectives.

Teardown: a gloo worker thread drops its reference to a finished collective's tensors a moment *after* the
caller has its result. If the interpreter has started to finalize by then, freeing a tensor that has a Python
object needs the GIL, Python ends the thread, and the forced unwind through gloo's destructor aborts the process
("terminate called without an active exception", SIGABRT) - a finished run reported as failed. `destroy_process_group`
does not prevent it: the Trainer's DDP wrapper keeps the process group and its threads alive until exit. So every
tensor handed to a collective here is kept until the backend has let go of it, and `settle()` waits for that at
`shutdown()` and at interpreter exit (an `atexit` hook, which runs before finalization, on every exit path).

All helpers work before `torch.distributed` is initialised and without it (they return the local value), on gloo
(CPU) and on NCCL (tensors are put on the current CUDA device, as NCCL requires).

Example:
    >>> stop = all_reduce_flag(self._signal_received)     # True on every rank if any rank got SIGTERM
    >>> worst = all_reduce_scalar(local_grad_norm, "max")
"""

from __future__ import annotations

import atexit
import os
import pickle
import time
from typing import Any, Literal

ReduceOp = Literal["sum", "max", "min", "mean"]

# Tensors of finished collectives the backend may still hold (see the module docstring); pruned on every call.
_IN_FLIGHT: list = []


def is_distributed() -> bool:
    """True when a torch.distributed process group with more than one rank is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def launch_world_size() -> int:
    """Processes of this launch, also before the process group exists (the doctor runs before the Trainer starts
    it): the group's size once it is up, else the launcher's WORLD_SIZE (torchrun and accelerate set it), else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def sharded_training(args) -> str | None:
    """Why gradients/parameters are sharded across ranks here (DeepSpeed ZeRO or FSDP), or None, from the arguments
    alone (before any engine exists; set by TrainingArguments `deepspeed=` / `fsdp=` or by `accelerate launch`'s
    environment). Where the gradients of a step live once training runs is `core.engine.StepEngine`'s answer; this is
    for decisions taken before (DeepSpeed owns the gradient accumulation, so batch warmup cannot change it).
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


def _held_elsewhere(tensor) -> bool:
    """True while something besides our Python reference holds `tensor` (a backend's finished work)."""
    use_count = getattr(tensor, "_use_count", None)  # torch's own reference count of the TensorImpl
    return use_count is not None and use_count() > 1


def _track(tensor) -> None:
    _IN_FLIGHT[:] = [t for t in _IN_FLIGHT if _held_elsewhere(t)]
    _IN_FLIGHT.append(tensor)


def settle(timeout: float = 10.0) -> bool:
    """Wait until the backend has let go of every tensor our collectives used; True when none is held any more.

    Local (no collective), so safe on any exit path. Called by `shutdown()` and, through `atexit`, before the
    interpreter finalizes (see the module docstring for why). Gives up after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        _IN_FLIGHT[:] = [t for t in _IN_FLIGHT if _held_elsewhere(t)]
        if not _IN_FLIGHT:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


atexit.register(settle)

_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def _private_copy(tensor):
    """A fresh copy on the backend's device: the only reference is ours, so `settle` can tell when the backend
    has let go of it (a caller's tensor may be held by autograd or views for other reasons)."""
    return tensor.detach().to(_collective_device(), copy=True).contiguous()


def all_reduce_tensor(tensor, op: ReduceOp = "sum"):
    """Reduce `tensor` over ranks in place (`sum`, `max`, `min` or `mean`) and return it; unchanged when not
    distributed. Any device works (the reduction runs on a copy on the backend's device).

    Raises:
        ValueError: `op` is not one of the four names.
    """
    if op not in _OPS:
        raise ValueError(f"op: got {op!r}, must be one of 'sum', 'max', 'min', 'mean'")
    if not is_distributed():
        return tensor
    import torch.distributed as dist

    work = _private_copy(tensor)
    dist.all_reduce(work, op=getattr(dist.ReduceOp, _OPS[op]))
    _track(work)
    if op == "mean":
        work = work / dist.get_world_size()
    tensor.copy_(work)
    return tensor


def all_gather_tensor(tensor):
    """Every rank's `tensor` stacked along a new first dimension (`[world_size, *shape]`), on every rank, on the
    tensor's device; the local tensor with a leading dimension of 1 when not distributed. Every rank must pass the
    same shape and dtype."""
    if not is_distributed():
        return tensor.unsqueeze(0)
    import torch
    import torch.distributed as dist

    local = _private_copy(tensor).reshape(-1)
    out = torch.empty(dist.get_world_size() * local.numel(), dtype=local.dtype, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, local)  # flat: gloo wants the output as the ranks' inputs concatenated
    _track(local)
    _track(out)
    return out.to(tensor.device, copy=True).reshape(dist.get_world_size(), *tensor.shape)


def all_gather_lists(tensor, tail: list[float] = ()) -> list[list]:
    """`all_gather_tensor(tensor).tolist()` of a vector: every rank's values, one list per rank, on every rank (one
    process: the one list, without the leading dimension's op). `tail`: host numbers that end each rank's list (the
    same count on every rank), sent in the same collective (one process: appended, no tensor made)."""
    if not is_distributed():
        return [tensor.tolist() + list(tail)]
    if tail:
        import torch

        tensor = torch.cat([tensor, torch.tensor(tail, dtype=tensor.dtype, device=tensor.device)])
    return all_gather_tensor(tensor).tolist()


def all_gather_rows(local, fill: float = -1.0):
    """Every rank's rows ``[n_r, w]`` (the counts may differ) on every rank, ``[world_size * max n_r, w]``: each
    rank's block padded with rows of `fill` to the largest count. ``[0, w]`` when no rank has a row (then nothing is
    gathered: the count is agreed). Every rank enters it: one reduce, then one gather when any rank has rows."""
    import torch

    n = torch.tensor([float(local.shape[0])], dtype=torch.float32, device=local.device)
    n_max = int(all_reduce_tensor(n, "max").item())
    if n_max == 0:
        return local.new_zeros((0, local.shape[1]))
    padded = torch.full((n_max, local.shape[1]), fill, dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    return all_gather_tensor(padded).reshape(-1, local.shape[1])


def _broadcast_tensor(tensor, src: int):
    import torch.distributed as dist

    work = _private_copy(tensor)
    dist.broadcast(work, src=src)
    _track(work)
    tensor.copy_(work)
    return tensor


def all_reduce_scalar(value: float, op: ReduceOp = "sum") -> float:
    """Reduce one float across ranks (`sum`, `max`, `min` or `mean`); the local value when not distributed.

    The reduction runs in float64 so a sum of step counts or a max of norms is exact for every value a
    float64 holds (NaN propagates through `sum`/`mean`; `max`/`min` follow torch's NaN rules).

    Raises:
        ValueError: `op` is not one of the four names.
    """
    if op not in _OPS:
        raise ValueError(f"op: got {op!r}, must be one of 'sum', 'max', 'min', 'mean'")
    if not is_distributed():
        return float(value)
    import torch

    tensor = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    return float(all_reduce_tensor(tensor, op).item())


def all_reduce_flag(flag: bool, require: Literal["any", "all"] = "any") -> bool:
    """True on every rank when `flag` holds on any rank (`require="any"`) or on all ranks (`"all"`)."""
    if not is_distributed():
        return bool(flag)
    return all_reduce_scalar(1.0 if flag else 0.0, "max" if require == "any" else "min") > 0.5


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (picklable objects); `obj` itself when not distributed.

    Used for decisions that read the file system (which checkpoint to resume from): with node-local disks
    the ranks could see different files, so the main process decides and the others follow. (Pickled and
    broadcast here rather than with `broadcast_object_list`, whose tensors `settle` could not track.)
    """
    if not is_distributed():
        return obj
    import torch

    mine = rank() == src
    payload = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    size = int(_broadcast_tensor(size, src).item())
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if mine else torch.empty(size, dtype=torch.uint8)
    return pickle.loads(_broadcast_tensor(data, src).numpy().tobytes())


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

    * Refuses FSDP1 (`core.engine.refuse_fsdp1`) before any model is built.

    Raises:
        ConfigError: `WORLD_SIZE` > 1 but `args.world_size` differs, or FSDP1; the message says how to fix it.
    """
    from hf_stable.core.engine import refuse_fsdp1

    refuse_fsdp1(args)
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
    """End of a distributed run: wait for every rank, let the backend release our tensors, tear the process group
    down (no-op otherwise). Call it on every rank, after the last collective of the run.

    Without the wait the main process, which writes the report and model card, exits seconds after the others;
    without `settle` a gloo worker thread can still hold a tensor when the interpreter finalizes and abort the
    process (see the module docstring).
    """
    if not is_distributed():
        settle()
        return
    import torch.distributed as dist

    barrier()
    settle()
    dist.destroy_process_group()
