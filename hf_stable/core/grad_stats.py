"""`GradStats`: every gradient statistic of one optimizer step, computed once, on device, with one host transfer.

A per-parameter `p.grad.norm().item()` loop syncs once per tensor. Here per-tensor L2 norms and max-|g| come from
two foreach-norm calls (`compat`), per-group sums from `index_add_`, and everything the monitors need (group and
global norms, max |grad| and where, non-finite tensors per group, scalars other monitors attach such as the loss)
is packed into one tensor and read with a single `.tolist()`.

* Shared: `GradStats.shared(model)` is one object per model, cached per step and keyed by a fingerprint of the
  gradients (tensor identity + version counter), so a gradient changed after the statistics were taken (a user's
  callback, a fault) is recomputed and guards judge what the optimizer applies. Our own clips run inside
  `edited()` and keep the pre-clip numbers. Not seen: writes through `p.grad.data`.
* Ranks: each rank's vector is gathered in the same transfer (one collective per step label) and the report holds
  the worst rank's value of each statistic, identical on every rank; `rank_norms` keeps each rank's global norm
  (`grad_rows`).
* When: `on_pre_optimizer_step` with `step=state.global_step` (gradients accumulated, all-reduced, unscaled; with
  `max_grad_norm > 0` also clipped by the stock Trainer, whose inf-clip turns every gradient NaN on a non-finite
  norm - `StableTrainer` avoids both).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable

import torch

from hf_stable.compat import foreach_norm, tensor_versions
from hf_stable.core.engine import StepEngine
from hf_stable.core.grad_report import DeviceGradStats, GradReport
from hf_stable.core.grad_rows import GradRows
from hf_stable.core.grad_span import SPAN, fingerprint, same_tensors, unchanged
from hf_stable.core.model_table import ModelTable
from hf_stable.core.step_readers import StepReaders
from hf_stable.optim.roles import group_parameters

__all__ = ["DeviceGradStats", "GradReport", "GradStats"]

_SHARED = ModelTable()
_PLAIN = StepEngine()


def _device_runs(devices: list) -> list[tuple[int, int]]:
    """[start, end) index ranges of consecutive equal devices."""
    runs, start = [], 0
    for i in range(1, len(devices) + 1):
        if i == len(devices) or devices[i] != devices[start]:
            runs.append((start, i))
            start = i
    return runs


class GradStats(GradRows):
    """Per-group gradient statistics with one device→host transfer per step, shared by monitors and guards.

    Args:
        model: the (unwrapped) model; its trainable parameters are grouped with `hf_stable.optim.roles`.
        groups: an explicit `{group: [(name, param), ...]}` instead of the role-based grouping.

    Example:
        >>> stats = GradStats.shared(model)             # in on_pre_optimizer_step
        >>> report = stats.compute(model, step=state.global_step, max_abs=True)
        >>> report.global_norm, report.group_norms["layer_0.lora_B"]
        >>> dev = stats.device_stats(model, step=state.global_step)   # device tensors, e.g. per-group clipping
    """

    def __init__(self, model: torch.nn.Module | None = None, groups: dict | None = None):
        self._model_ref = weakref.ref(model) if model is not None else None
        self._explicit_groups = groups
        self._entries: list[tuple[str, torch.nn.Parameter, int]] | None = None
        self._params: list[torch.nn.Parameter] = []
        self._full: tuple | None = None
        self._full_runs: list[tuple[int, int]] = []
        self._group_names: list[str] = []
        self._index_cache: dict = {}
        self._sources: dict[str, Callable[[], dict[str, torch.Tensor]]] = {}
        self._dev_key = None
        self._dev: DeviceGradStats | None = None
        self._host_key = None
        self._host: GradReport | None = None
        self._seen: tuple[list, list[int]] | None = None  # (weak refs, versions) of every gradient when computed
        self._trusted: tuple | None = None  # (span, key): the gradients were found the step's in this span (`_hit`)
        self._memo: tuple | None = None  # (span, step, key) of the last `compute`: its report holds for the span
        # Rank-agreed state of the current step label (see the module docstring): the gathered per-rank vectors.
        self._agreed_step: int | None = None
        self._agreed_rows: list[list[float]] | None = None
        self._agreed_keys: list[str] = []
        self._agreed_max = False
        self._agreed_dev_key = None  # the device statistics the rows were gathered from
        self.row_gathers = 0  # row gathers so far (rank-agreed): a reader tells whether its call gathered
        self.readers = StepReaders()  # monitors' reads deferred to the decider's gather (`core.step_readers`)
        # True when the Trainer takes these statistics before its own clip (`StableTrainer`): pre-clip numbers
        # even with `max_grad_norm > 0`.
        self.pre_clip = False
        # The device statistics the last `compute` read (checked against the gradients then): a caller that needs
        # both in one go takes them here instead of checking the gradients a second time.
        self.last_device_stats: DeviceGradStats | None = None

    @classmethod
    def shared(cls, model: torch.nn.Module) -> GradStats:
        """The one instance for `model` (created on first use), so every callback shares the step's result."""
        stats = _SHARED.get(model)
        if stats is None:
            stats = _SHARED[model] = cls(model)
        return stats

    # --- configuration ----------------------------------------------------------------------
    @property
    def engine(self) -> StepEngine:
        """Where the gradients live (`core.engine`): plain/DDP, FSDP2 or DeepSpeed ZeRO."""
        model = self._model_ref() if self._model_ref is not None else None
        return StepEngine.of(model) if model is not None else _PLAIN

    def _grads(self) -> list:
        """This rank's gradient of every statistics parameter (None where there is none)."""
        return self.engine.local_grads(self._params)

    def refresh(self) -> None:
        """Re-read the parameter groups (call after freezing/unfreezing parameters)."""
        self._entries = None
        self._index_cache = {}
        self.invalidate()

    def invalidate(self) -> None:
        """Forget the cached result (the next call computes again; the step's rank-agreed numbers are kept)."""
        self._dev_key = self._dev = self._host_key = self._host = self._seen = self._trusted = None

    def begin_step(self) -> None:
        """Forget the previous step's rank-agreed numbers (every rank calls it at the start of each step; hf_stable
        callbacks do, from `on_step_begin`), so a new run that reuses a step label gathers afresh."""
        self._agreed_step, self._agreed_rows, self._agreed_keys, self._agreed_max = None, None, [], False

    @contextlib.contextmanager
    def edited(self, step: int, scale: torch.Tensor | None = None, read: DeviceGradStats | None = None):
        """Context for hf_stable's own in-place edit of the step's gradients (a clip): the cached statistics stay
        the step's (pre-edit) numbers instead of being recomputed. `scale` (a device scalar, or one factor per
        entry of `device_stats().params`) is what the gradients were multiplied by: a max |g| read later, or a
        recomputation after a foreign edit, is divided by it, so readers stay on the pre-clip scale. `read`: the
        statistics the caller has just taken of step `step` with nothing run in between (its own clip follows), so
        they are not checked against the gradients again."""
        if read is not None and read is self._dev and self._dev_key is not None and self._dev_key[0] == step:
            valid = True
        else:
            valid = self._dev is not None and self._hit(self._dev_key, step)
        yield
        if valid:
            dev = self._dev
            if scale is not None:
                dev.scale = scale if dev.scale is None else dev.scale * scale
            # edited in place: the same tensors (their references kept), at new versions
            self._seen = (self._seen[0], tensor_versions(self._grads()))

    @property
    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Every trainable (name, parameter) in the statistics' order, with or without a gradient (the same list on
        every rank, so a per-tensor vector over it can be reduced across ranks)."""
        return [(n, p) for n, p, _ in self._ensure_entries()]

    @property
    def group_names(self) -> list[str]:
        """The group names, in the order of `group_norms`."""
        self._ensure_entries()
        return list(self._group_names)

    def add_source(self, name: str, fn: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Attach on-device scalars to every transfer: `fn()` returns `{key: 0-d tensor}` (may be empty).

        The values are summed over ranks (when torch.distributed is initialized) inside the same transfer, so
        every rank reads the same numbers; every rank must therefore call `compute` at the same steps (it is a
        collective, once per step label).
        """
        self._sources[name] = fn

    def _ensure_entries(self) -> list[tuple[str, torch.nn.Parameter, int]]:
        if self._entries is None:
            model = self._model_ref() if self._model_ref is not None else None
            groups = self._explicit_groups
            if groups is None:
                if model is None:
                    raise ValueError("GradStats needs a model or explicit groups")
                groups = group_parameters(model, trainable_only=True)
            self._group_names = list(groups)
            entries = [(n, p, gi) for gi, g in enumerate(self._group_names) for n, p in groups[g]]
            # Device-contiguous order (stable): one foreach call per device, for the full set and any subset.
            order = {}
            for _, p, _ in entries:
                order.setdefault(p.device, len(order))
            self._entries = sorted(entries, key=lambda e: order[e[1].device])
            self._params = [p for _, p, _ in self._entries]
            self._full_runs = _device_runs([p.device for p in self._params])
            self._full = None  # (names, params, group_ids, group index) of the all-gradients case, built on first use
        return self._entries

    # --- on-device statistics -------------------------------------------------------------------
    def _present(self):
        """(entries, grads) of the parameters that have a gradient now, and every parameter's gradient."""
        entries = self._ensure_entries()
        grads = self._grads()
        if any(g is None for g in grads):
            present = [e for e, g in zip(entries, grads, strict=False) if g is not None]
            return present, [g for g in grads if g is not None], grads
        return entries, grads, grads

    @staticmethod
    def _key(step):
        """A new key per computation: the step label plus a token, so a recomputation invalidates the host report."""
        return None if step is None else (step, object())

    def _hit(self, key, step) -> bool:
        """Same step label and the same gradients: every tensor the same object at the same version, or every
        gradient dropped since (a skip in this step).

        A gradient edited in place or replaced since, a new run restarting the step count, or
        `zero_grad(set_to_none=False)` reuse across steps all miss. Cost: two attribute reads per tensor; none when
        the gradients were found the step's earlier in the same span of hf_stable's own callbacks (`open_span`:
        nothing else has run since).
        """
        if key is None or step is None or key[0] != step or self._seen is None:
            return False
        span = SPAN[0]
        trusted = self._trusted
        if span is not None and trusted is not None and trusted[0] is span and trusted[1] is key:
            return True
        hit = unchanged(self._grads(), self._seen)
        self._trusted = (span, key) if hit and span is not None else None
        return hit

    def _carried_scale(self, step, grads: list, present) -> torch.Tensor | None:
        """The clip scale of this step's previous computation when the gradients were edited in place since (same
        tensors, new versions), so the recomputed numbers stay on the pre-clip scale; None otherwise."""
        dev = self._dev
        if dev is None or dev.scale is None or self._dev_key is None or self._dev_key[0] != step:
            return None
        if not same_tensors(grads, self._seen[0]):
            return None
        if dev.scale.dim() == 0 or (present is self._entries and dev.scale.numel() == len(self._params)):
            return dev.scale
        return None

    def _group_index(self, idx: tuple[int, ...], device) -> torch.Tensor:
        key = (idx, str(device))
        out = self._index_cache.get(key)
        if out is None:
            out = torch.tensor(idx, dtype=torch.long, device=device)
            if len(self._index_cache) > 8:
                self._index_cache.clear()
            self._index_cache[key] = out
        return out

    def device_stats(self, model: torch.nn.Module | None = None, step: int | None = None) -> DeviceGradStats | None:
        """Statistics as device tensors, computed once per step; None when no parameter has a gradient."""
        if model is not None and (self._model_ref is None or self._model_ref() is not model):
            self._model_ref, self._entries = weakref.ref(model), None
            self.invalidate()
        self._ensure_entries()
        if self._hit(self._dev_key, step):
            return self._dev
        present, grads, every = self._present()
        carried = self._carried_scale(step, every, present) if self._seen is not None else None
        self._seen = fingerprint(every)
        if not grads or type(grads[0]).__name__ == "DTensor" or type(grads[-1]).__name__ == "DTensor":
            self._dev_key, self._dev = self._key(step), None
            self._trust()
            return None
        home = grads[0].device
        # One foreach call per device (entries are device-contiguous), results gathered on the first device.
        # A gradient lives on its parameter's device, so the runs of the full set are known in advance.
        runs = self._full_runs if present is self._entries else _device_runs([g.device for g in grads])
        l2 = [torch.stack(foreach_norm(grads[a:b], 2.0)).to(home) for a, b in runs]
        param_norms = torch.cat(l2) if len(l2) > 1 else l2[0]
        if carried is not None:
            param_norms = param_norms / carried.to(home)
        if present is self._entries:  # the usual case: every trainable tensor has a gradient
            if self._full is None or self._full[3].device != home:
                ids = [gi for _, _, gi in present]
                self._full = ([n for n, _, _ in present], list(self._params), ids, self._group_index(tuple(ids), home))
            names, params, group_ids, gidx = self._full
        else:
            names, params, group_ids = [n for n, _, _ in present], [p for _, p, _ in present], [e[2] for e in present]
            gidx = self._group_index(tuple(group_ids), home)
        # The squares sit in column 0 of an [n, 2] block (the global norm sums that strided column, whose order of
        # addition - and so every bit of the norm - is the layout's). Sharded engines also sum a non-finite flag per
        # tensor there, in the same index_add (a norm is >= 0, inf or NaN: times 0 it is NaN exactly when it is not
        # finite); otherwise the report counts the non-finite tensors on the host from the norms its row carries.
        n_groups = len(self._group_names)
        sharded = self.engine.sharded
        if sharded:
            columns = torch.stack([param_norms.square(), torch.isnan(param_norms * 0).to(torch.float32)], dim=1)
        else:
            columns = torch.empty(len(params), 2, dtype=torch.float32, device=home)
            torch.square(param_norms, out=columns[:, 0])
        squares = columns[:, 0]
        if sharded:
            sums = torch.zeros(n_groups, 2, dtype=torch.float32, device=home).index_add_(0, gidx, columns)
            group_squares, nonfinite = sums[:, 0], sums[:, 1]
        else:
            group_squares = torch.zeros(n_groups, dtype=torch.float32, device=home).index_add_(0, gidx, squares)
            nonfinite = None
        self._dev = DeviceGradStats(
            names=names,
            params=params,
            groups=self._group_names,
            group_index=gidx,
            param_norms=param_norms,
            param_max_abs=None,
            group_norms=group_squares.sqrt(),
            nonfinite=nonfinite,
            global_norm=squares.sum().sqrt(),
            group_ids=group_ids,
            scale=carried,
        )
        self._dev_key = self._key(step)
        self._trust()
        return self._dev

    def _trust(self) -> None:
        """The gradients were just read: inside a span of hf_stable's callbacks they need no check until it ends."""
        span = SPAN[0]
        self._trusted = (span, self._dev_key) if span is not None else None

    def _param_max_abs(self, dev: DeviceGradStats) -> torch.Tensor | None:
        """Per-tensor max |g| (computed once per step, on request); None when gradients were dropped since
        (a guard skipped the step by setting `p.grad = None`)."""
        if dev.param_max_abs is None:
            grads = self.engine.local_grads(dev.params)
            if any(g is None for g in grads):
                return None
            home = dev.param_norms.device
            if home.type == "cpu":
                # The CPU foreach inf-norm kernel is a slow scalar loop; aminmax per tensor is ~2-10x faster.
                lows, highs = zip(
                    *(g.aminmax() if g.numel() else (g.new_zeros(()), g.new_zeros(())) for g in grads), strict=False
                )
                low, high = torch.stack(lows).to(torch.float32), torch.stack(highs).to(torch.float32)
                dev.param_max_abs = torch.maximum(high, -low)
            else:
                dev.param_max_abs = torch.stack([n.to(home) for n in foreach_norm(grads, math.inf)])
            if dev.scale is not None:  # the gradients were clipped since the norms were taken: undo it here
                dev.param_max_abs = dev.param_max_abs / dev.scale.to(home)
        return dev.param_max_abs

    # --- host report (the per-rank rows, their gather and combination: `grad_rows.GradRows`) -------------------
    def compute(
        self, model: torch.nn.Module | None = None, step: int | None = None, max_abs: bool = False
    ) -> GradReport:
        """Host-side report of the step (cached per step), transferred with one `.tolist()`; the same on every rank.

        `max_abs=False` skips the exact max |g| (a second pass over every gradient); the report then carries
        `max_norm_param` / `max_param_norm`, the largest per-tensor L2 norm, which bounds max |g| from above,
        so a caller can ask for the exact value (one more transfer) only when the bound crosses its threshold.
        The exact max |g| reads the gradients as they are when it is asked for: ask before modifying them.
        Distributed: a collective - every rank calls it at the same points with the same `max_abs`. A max |g| that a
        deferred reader asked for (`readers`) is taken in the same collective.
        """
        max_abs = max_abs or self.readers.wants_max_abs(step)
        span = SPAN[0]
        memo = self._memo
        if (  # asked again in the span that computed it (nothing else ran since): the same report, nothing to check
            span is not None
            and memo is not None
            and memo[0] is span
            and memo[1] == step
            and memo[2] is self._dev_key
            and self._agreed_step == step
            and (self._agreed_max or not max_abs)
            and (model is None or (self._model_ref is not None and self._model_ref() is model))
        ):
            self.last_device_stats = self._dev
            return self._host
        dev = self.last_device_stats = self.device_stats(model, step)
        cached = self._host is not None and self._dev_key is not None and self._host_key is self._dev_key
        gather = self._needs_gather(step, max_abs)
        if gather:
            self._gather(dev, step, max_abs)
        gather = self._refresh_own_row(dev, step) or gather
        if not (cached and not gather):
            report = self._report(dev, step)
            if cached:  # the step's report grew its exact max |g|: update the object earlier readers hold
                self._host.__dict__.update(report.__dict__)
            else:
                self._host, self._host_key = report, self._dev_key
        self._memo = (span, step, self._dev_key) if span is not None else None
        return self._host


def begin_step(model: torch.nn.Module | None) -> None:
    """`GradStats.begin_step` of `model`'s shared instance, if it has one (called from `on_step_begin`)."""
    stats = _SHARED.get(model) if model is not None else None
    if stats is not None:
        stats.begin_step()
