"""The two result types of `GradStats`: `DeviceGradStats` (device tensors, no host sync) and `GradReport` (host
numbers of one step, as monitors and guards read them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class DeviceGradStats:
    """The step's gradient statistics as device tensors (no host sync). Order follows `names`.

    Args:
        names: parameter names that had a gradient, in the order of the per-parameter tensors.
        params: the matching parameters (so a clipping guard can scale `p.grad` per group).
        groups: group names; `group_index[i]` is the group of `names[i]`.
        group_index: long tensor [P].
        param_norms: float32 [P] L2 norm of each gradient.
        param_max_abs: float32 [P] max |g| of each gradient, or None until asked for (see `GradStats.compute`).
        group_norms: float32 [G] L2 norm per group.
        nonfinite: float32 [G] number of tensors per group whose gradient holds NaN/Inf, under a sharded engine;
            None otherwise (the report counts them on the host from the per-tensor norms).
        global_norm: float32 scalar, L2 norm over every gradient.
        group_ids: host copy of `group_index` (known without a transfer).
        scale: device scalar the gradients were multiplied by after these statistics were taken (a clip by
            `StableTrainer`), or None. The norms stay pre-clip; a later max |g| read is divided by it.
    """

    names: list[str]
    params: list[torch.nn.Parameter]
    groups: list[str]
    group_index: torch.Tensor
    param_norms: torch.Tensor
    param_max_abs: torch.Tensor | None
    group_norms: torch.Tensor
    nonfinite: torch.Tensor | None
    global_norm: torch.Tensor
    group_ids: list[int]
    scale: torch.Tensor | None = None


@dataclass
class GradReport:
    """Host-side gradient statistics of one step.

    `available` is False when no trainable parameter had a gradient (DeepSpeed ZeRO keeps gradients in its own
    buffers; sharded FSDP gradients are not read; on any rank) — then every number is NaN/empty, never zero.
    `extras` holds the attached on-device scalars (summed over ranks), e.g. the step's loss. Every number is the
    same on every rank: the worst rank's (see `GradStats`); `rank_norms` lists each rank's global norm. `max_abs` (and where) is filled
    only when asked for (`has_max_abs`); `max_param_norm` (the largest per-tensor L2 norm, an upper bound of
    max |g|) always is. Non-finite tensors are left out of both maxima.
    """

    step: int | None
    available: bool
    reason: str = ""
    global_norm: float = math.nan
    group_norms: dict[str, float] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)
    max_abs: float = math.nan
    max_abs_group: str | None = None
    max_abs_param: str | None = None
    has_max_abs: bool = False
    max_param_norm: float = math.nan
    max_norm_param: str | None = None
    n_tensors: int = 0
    extras: dict[str, float] = field(default_factory=dict)
    rank_norms: list[float] = field(default_factory=list)
    # True when each rank held a part of every gradient (FSDP2, DeepSpeed ZeRO): the numbers are the sums over the
    # ranks' parts and `rank_norms` are the parts' norms, which differ by nature
    sharded: bool = False

    @property
    def nonfinite_total(self) -> int:
        return sum(self.nonfinite.values())

    @property
    def ranks_differ(self) -> bool:
        """True when the ranks' gradients are not the same (their global norms differ bitwise). After DDP's all-reduce
        they are identical, so a gradient was changed on one rank afterwards (a fault, a callback on one rank):
        applying it would silently turn the replicas into different models."""
        if self.sharded:
            return False
        return self.available and len({"nan" if math.isnan(v) else v for v in self.rank_norms}) > 1

    def metrics(self) -> dict[str, float]:
        """Namespaced metrics for the Trainer logs. Per-group non-finite counts appear only when non-zero."""
        if not self.available:
            return {}
        out = {"grad/norm_global": self.global_norm}
        if self.has_max_abs:
            out["grad/max_abs"] = self.max_abs
        out.update({f"grad/norm/{g}": v for g, v in self.group_norms.items()})
        out["grad/nonfinite_total"] = float(self.nonfinite_total)
        out.update({f"grad/nonfinite/{g}": float(n) for g, n in self.nonfinite.items() if n})
        return out
