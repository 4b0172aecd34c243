"""How large the rollback guard's host buffers get, and whether they fit, decided before the first snapshot.

A snapshot holds the trainable weights and the optimizer state as the optimizer will hold them. For LoRA that is a
few MB; for a full fine-tune of a 7-8B model in fp32 with AdamW it is ~90 GB per rank (weights plus two moments),
and the rollback check copies the live trainable weights once more while it probes. Before the first step AdamW
has no state yet, so the state is predicted from the optimizer type: AdamW/Adam 2 tensors per parameter (3 with
amsgrad), SGD 1 with momentum (0 without), Lion 1, RMSprop 1-3, Adagrad 1, anything else 2; in the parameter's
dtype (what torch and lion-pytorch allocate). Once the optimizer holds state (a resumed run) it is measured.

The budget is the host's available memory (`psutil`), times `share`, divided by the ranks on this host
(`LOCAL_WORLD_SIZE`); the disk budget is the free space of the output directory, split the same way. The other
buffers hf_stable keeps are small: captured micro-batches are references to the batch tensors of the current step
(kept until the next step starts, no copies), and the per-step histories (loss windows, trends) are bounded deques;
what grows without bound is one entry per *event* (each callback's event list, the locator's non-finite steps).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hf_stable.core.snapshot import optimizer_params
from hf_stable.optim.bnb import STATE_TENSORS as BNB_STATE_TENSORS
from hf_stable.optim.bnb import predicted_state_bytes, state_bytes
from hf_stable.optim.phases import unwrap_optimizer

GIB = 1024**3


def human(n: float) -> str:
    """Bytes as GiB (or MiB below 1 GiB), three significant digits."""
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / 1024**2:.3g} MiB"


# State tensors per parameter (each the size of the parameter), by optimizer class name (lower case).
_STATE_TENSORS = {"adamw": 2, "adam": 2, "nadam": 2, "radam": 2, "adamax": 2, "lion": 1, "adagrad": 1, "sgd": 1}
_PHASE_TENSORS = {"adamw": 2, "sgd": 1, "lion": 1}  # by optim.name / optimizer-phase name


def available_host_memory() -> int:
    """Bytes of host memory available now (the one place that reads it: tests patch this)."""
    import psutil

    return int(psutil.virtual_memory().available)


def free_disk(path) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return int(shutil.disk_usage(path).free)


def local_ranks() -> int:
    """Training processes on this host (they share its memory and disk)."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def _state_tensors(opt) -> int:
    names = getattr(opt, "names", None)
    if names:  # a PhasedOptimizer: the largest of its phases
        return max(_PHASE_TENSORS.get(n, 2) for n in names)
    name = type(getattr(opt, "current", opt)).__name__.lower()
    groups = getattr(opt, "param_groups", [])
    if name == "sgd":
        return int(any(g.get("momentum", 0) for g in groups))
    if name == "rmsprop":
        return 1 + int(any(g.get("momentum", 0) for g in groups)) + int(any(g.get("centered") for g in groups))
    base = _STATE_TENSORS.get(name, 2)
    return base + int(name.startswith("adam") and any(g.get("amsgrad") for g in groups))


@dataclass
class SnapshotSize:
    """Bytes of one snapshot (`params` + `state`) and of the rollback check's copy of the live weights (`probe`)."""

    params: int
    state: int
    probe: int
    state_measured: bool

    @property
    def snapshot(self) -> int:
        return self.params + self.state

    def host_bytes(self, storage: str, verify: bool) -> int:
        """Host memory a snapshot needs: all of it in memory, none on disk; plus the probe's copy when verifying."""
        return (self.snapshot if storage == "memory" else 0) + (self.probe if verify else 0)

    def describe(self) -> str:
        how = "measured" if self.state_measured else "predicted from the optimizer type"
        return (
            f"trainable weights {human(self.params)} + optimizer state {human(self.state)} "
            f"({how}) = {human(self.snapshot)} per snapshot; the rollback check copies the weights "
            f"once more ({human(self.probe)}) while it probes"
        )


def snapshot_size(optimizer) -> SnapshotSize:
    """The sizes for `optimizer` (accelerate's wrapper or a bare torch optimizer)."""
    opt = unwrap_optimizer(optimizer)
    params = optimizer_params(opt)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    held = [s for p, s in opt.state.items() if s]
    if held:
        state = sum(v.numel() * v.element_size() for s in held for v in s.values() if hasattr(v, "element_size"))
        return SnapshotSize(param_bytes, state, param_bytes, True)
    predicted = predicted_state_bytes(opt)  # bitsandbytes' 8-bit state: ~1 byte per value, not the param's dtype
    state = predicted if predicted is not None else _state_tensors(opt) * param_bytes
    return SnapshotSize(param_bytes, state, param_bytes, False)


def estimate_size(trainable_numel: int, dtype_bytes: int, optimizer_name: str) -> SnapshotSize:
    """The sizes from a parameter count (the doctor, before any optimizer exists)."""
    params = trainable_numel * dtype_bytes
    if optimizer_name in BNB_STATE_TENSORS:
        return SnapshotSize(params, state_bytes(trainable_numel, BNB_STATE_TENSORS[optimizer_name], 0), params, False)
    return SnapshotSize(params, _PHASE_TENSORS.get(optimizer_name, 2) * params, params, False)


@dataclass
class StoragePlan:
    """Where snapshots can live: `storage` ("memory"/"disk"), or `error` (fits nowhere); `note` explains a switch."""

    storage: str
    verify: bool
    error: str = ""
    note: str = ""


def plan_storage(size: SnapshotSize, storage: str, verify: bool, output_dir, share: float) -> StoragePlan:
    """Keep `storage` when it fits; memory that does not fit → disk (with a note); fitting nowhere → `error`."""
    ranks = local_ranks()
    mem = available_host_memory() * share / ranks
    disk = free_disk(output_dir) / ranks
    need_mem = size.host_bytes(storage, verify)
    facts = (
        f"{size.describe()}; host memory available {human(available_host_memory())} x share {share} / "
        f"{ranks} rank(s) on this host = {human(mem)} per rank"
    )
    if storage == "memory" and need_mem <= mem:
        return StoragePlan("memory", verify)
    disk_facts = f"free disk under {output_dir}: {human(disk * ranks)} / {ranks} rank(s)"
    if size.snapshot <= disk and size.host_bytes("disk", verify) <= mem:
        note = (
            ""
            if storage == "disk"
            else (
                f"rollback snapshots do not fit in host memory ({human(need_mem)} needed): {facts}. Switched "
                f"stability.guards.rollback.storage to disk ({disk_facts}); set it to disk to silence this, or lower "
                "the snapshot size (LoRA: lora.enabled: true)"
            )
        )
        return StoragePlan("disk", verify, note=note)
    if size.snapshot <= disk and size.host_bytes("disk", False) <= mem:
        note = (
            f"the rollback check's copy of the weights does not fit in host memory: {facts}. Snapshots go to "
            f"disk ({disk_facts}) and stability.guards.rollback.verify is off (bad data may now be rolled back)"
        )
        return StoragePlan("disk", False, note=note)
    error = (
        f"rollback snapshots fit neither in host memory nor on disk: {facts}; {disk_facts}. Set "
        "stability.guards.rollback.enabled: false, free disk space under training.output_dir (storage: disk), "
        "or train fewer parameters (lora.enabled: true)"
    )
    return StoragePlan(storage, verify, error=error)
