"""`SnapshotStore`: the rollback guard's one snapshot of the trainable weights, the optimizer state and the guards'
references - in CPU memory, or in one file per rank.

`memory` keeps CPU copies (for LoRA a few MB). `disk` never builds a host copy of the whole snapshot: `torch.save`
is handed the live tensors and moves one storage at a time to the host while writing (the training is paused in
`on_step_end`), and a restore maps the file (`torch.load(mmap=True)`) and copies tensor by tensor into the live
ones. The previous file is removed before the next one is written, so the disk holds one snapshot at a time (a
snapshot is never read after a crash: a resumed run takes a fresh one from its checkpoint).

The file holds only tensors (in lists, dicts and tuples with int keys and device strings): the Python values (an
int step in the optimizer state, the guards' references) stay in memory, and the file is read back with
`torch.load(weights_only=True)`. A file that holds anything else (a pickle planted in the output dir that would
run code when loaded) is refused with a `SnapshotError` naming it, before any of its code runs.

Restoring copies the saved tensors back into the live ones (`copy_`: dtype, device and identity stay, the values are
bitwise equal) and removes optimizer state that did not exist at snapshot time. If the optimizer was switched
(optimizer phases) since the snapshot, only the weights are restored and the new optimizer's state is reset.

Sharded engines (`core.engine`): every tensor is this rank's part (`engine.local`: an FSDP2 shard, a ZeRO
partition), so a snapshot holds 1/N of the state per rank and a restore is local - no collective. DeepSpeed's
optimizer updates fp32 partitions, so the model's own weights (`engine.extra_snapshot_tensors`) are saved too.
"""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import torch

from hf_stable.compat import deepspeed_master_partitions
from hf_stable.core.engine import StepEngine
from hf_stable.errors import HfStableError
from hf_stable.optim.phases import unwrap_optimizer

_PLAIN = StepEngine()
_IN_FILE = ("params", "state", "extra")  # a disk snapshot's tensors; the rest stays in memory


class SnapshotError(HfStableError):
    """This rank's rollback snapshot file cannot be used (the message names the file)."""

    rank_local = True


def optimizer_params(optimizer) -> list[torch.Tensor]:
    """The parameters the optimizer updates, in param-group order (a ZeRO optimizer: its fp32 partitions)."""
    opt = unwrap_optimizer(optimizer)
    for candidate in (optimizer, opt):  # accelerate's wrapper, or the ZeRO optimizer itself
        masters = deepspeed_master_partitions(candidate)
        if masters is not None:
            return masters
    return [p for g in opt.param_groups for p in g["params"]]


def _optimizer_type(opt) -> str:
    return type(getattr(opt, "current", opt)).__name__


class SnapshotStore:
    """Holds one snapshot; `storage` is "memory" or "disk" (then `path` is this rank's file).

    Example:
        >>> store = SnapshotStore("memory")
        >>> store.save(step, optimizer, guard_states={"SkipGuard": skip.stats_state()})
        >>> step, same_optimizer, guard_states = store.restore(optimizer)
    """

    def __init__(self, storage: str, path: Path | None = None):
        self.storage = storage
        self.path = path
        self._snap: dict | None = None  # memory: the snapshot; disk: {"step", "guard_states"}
        self._buffers: list[torch.Tensor] | None = None  # memory: the snapshot's host tensors, refilled by `save`
        self.step: int | None = None

    @property
    def empty(self) -> bool:
        return self._snap is None

    def save(self, step: int, optimizer, guard_states: dict, engine: StepEngine | None = None, model=None) -> None:
        engine = engine or _PLAIN
        opt = unwrap_optimizer(optimizer)
        params = optimizer_params(opt)
        index = {id(p): i for i, p in enumerate(params)}
        to_cpu = self.storage != "disk" or self.path is None

        sources: list[torch.Tensor] = []  # every tensor kept, in the order `keep` met them
        # host copies are made under no_grad: the tensors are read as they are; the disk file gets detached ones
        local_of = engine.local_no_grad if to_cpu else engine.local

        def keep(t: torch.Tensor) -> torch.Tensor:
            local = local_of(t)
            sources.append(local)
            return local

        snap = {
            "step": step,
            "optimizer_type": _optimizer_type(opt),
            "params": [keep(p) for p in params],
            "state": {
                index[id(p)]: {
                    k: (keep(v), str(v.device)) if isinstance(v, torch.Tensor) else (None, copy.deepcopy(v))
                    for k, v in s.items()
                }
                for p, s in opt.state.items()
                if id(p) in index
            },
            "extra": [keep(t) for t in (engine.extra_snapshot_tensors(model) if model is not None else [])],
            "guard_states": copy.deepcopy(guard_states),
        }
        if to_cpu:  # the host copies: the previous snapshot's buffers refilled in one foreach copy when they fit
            copies = self._host_copies(sources)
            swap = {id(src): dst for src, dst in zip(sources, copies, strict=True)}
            snap["params"] = [swap[id(t)] for t in snap["params"]]
            snap["extra"] = [swap[id(t)] for t in snap["extra"]]
            for entry in snap["state"].values():
                for k, (value, device) in entry.items():
                    if value is not None:
                        entry[k] = (swap[id(value)], device)
        if not to_cpu:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.unlink(missing_ok=True)  # one snapshot on disk at a time
            # the file gets the tensors only (what weights_only=True loads); Python values stay here
            state = snap["state"]
            tensors = {i: {k: e for k, e in s.items() if e[0] is not None} for i, s in state.items()}
            torch.save({"params": snap["params"], "state": tensors, "extra": snap["extra"]}, self.path)
            snap = {k: v for k, v in snap.items() if k not in _IN_FILE}
            snap["values"] = {i: {k: e for k, e in s.items() if e[0] is None} for i, s in state.items()}
        self._snap, self.step = snap, step

    def _host_copies(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU copies of `sources`. The store holds one snapshot and `restore` only copies out of it, so the
        previous snapshot's buffers are reused when every shape and dtype matches (no allocation per tensor)."""
        old = self._buffers
        if (
            old is None
            or len(old) != len(sources)
            or any(b.shape != t.shape or b.dtype != t.dtype for b, t in zip(old, sources, strict=True))
        ):
            with torch.no_grad():
                self._buffers = [t.to("cpu", copy=True) for t in sources]
            return self._buffers
        with torch.no_grad():
            torch._foreach_copy_(old, sources)
        return old

    def load(self) -> dict | None:
        """The whole snapshot (disk: memory-mapped, read on access).

        Raises:
            SnapshotError: the disk file holds more than tensors (nothing in it is run) or cannot be read.
        """
        if self._snap is None or "params" in self._snap:
            return self._snap
        tensors = _load_tensors(self.path)
        state = tensors["state"]
        for i, values in self._snap["values"].items():
            state[i] = {**state.get(i, {}), **copy.deepcopy(values)}
        kept = {k: v for k, v in self._snap.items() if k != "values"}
        return {**kept, "params": tensors["params"], "state": state, "extra": tensors.get("extra", [])}

    def guard_states(self) -> dict:
        return {} if self._snap is None else self._snap["guard_states"]

    def restore(self, optimizer, engine: StepEngine | None = None, model=None) -> tuple[int, bool, dict]:
        """Put the snapshot back; returns (its step, whether the optimizer state was restored too, the guards'
        saved references)."""
        engine = engine or _PLAIN
        snap = self.load()
        opt = unwrap_optimizer(optimizer)
        params = optimizer_params(opt)
        if snap is None or len(snap["params"]) != len(params):
            raise RuntimeError("rollback snapshot does not match the optimizer's parameters")
        extra = engine.extra_snapshot_tensors(model) if model is not None else []
        if len(extra) != len(snap.get("extra", [])):
            raise RuntimeError("rollback snapshot does not match the model's trainable weights")
        with torch.no_grad():
            for p, saved in zip([*params, *extra], [*snap["params"], *snap.get("extra", [])], strict=True):
                engine.local(p).copy_(saved)
        same_opt = snap["optimizer_type"] == _optimizer_type(opt)
        for i, p in enumerate(params):
            saved = snap["state"].get(i) if same_opt else None
            if saved is None:
                opt.state.pop(p, None)
                continue
            live = opt.state[p]
            for key in [k for k in live if k not in saved]:
                del live[key]
            for key, (value, device) in saved.items():
                if value is None:
                    live[key] = copy.deepcopy(device)
                    continue
                cur = live.get(key)
                local = engine.local(cur) if isinstance(cur, torch.Tensor) else None
                if local is not None and local.shape == value.shape and local.dtype == value.dtype:
                    local.copy_(value)
                else:
                    live[key] = value.to(device, copy=True)
        return snap["step"], same_opt, snap["guard_states"]


def _load_tensors(path: Path) -> dict:
    """Read a disk snapshot with `torch.load(weights_only=True)`: tensors and plain values only, no code runs."""
    fix = (
        "check who else can write to the output dir, then rerun the same command (it resumes from its last complete "
        "checkpoint and writes a fresh snapshot)"
    )
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL [\w.]+|Unsupported [\w ]+", str(e))
        detail = found.group(0) if found else "not a snapshot"
        raise SnapshotError(
            f"rollback snapshot {path}: refused to load it, it holds more than tensors ({detail})"
            f"; hf_stable writes only tensors there, so something else wrote this file; {fix}"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise SnapshotError(f"rollback snapshot {path} cannot be read ({type(e).__name__}: {e}); {fix}") from None
    if not (isinstance(data, dict) and isinstance(data.get("params"), list) and isinstance(data.get("state"), dict)):
        raise SnapshotError(f"rollback snapshot {path} is not a snapshot hf_stable wrote; {fix}")
    return data
