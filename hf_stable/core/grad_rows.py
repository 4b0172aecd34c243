"""`GradRows`: the host half of `GradStats` - each rank's statistics packed into one vector, the step's one
collective that gathers the vectors (one row per rank, kept for the step label so every rank reads the same
numbers), and the report those rows give: the worst rank of each statistic, or under sharded engines the sums of
the ranks' parts (`grad_combine`)."""

from __future__ import annotations

import math

import torch

from hf_stable.core.grad_combine import best_rank as _best_rank
from hf_stable.core.grad_combine import fill_max_abs, sharded_report
from hf_stable.core.grad_combine import worst as _worst
from hf_stable.core.grad_report import DeviceGradStats, GradReport
from hf_stable.distributed import all_gather_lists, all_gather_tensor, is_distributed, rank

_CONSTANTS: dict = {}


def top_of(norms: list[float]) -> tuple[float, float]:
    """(the largest finite value, its first index) of a rank's per-tensor norms; (-1, 0) when none is finite (a
    tensor without a gradient counts -1)."""
    finite = [v if v < math.inf else -1.0 for v in norms]  # (NaN < inf is False)
    best = max(finite, default=-1.0)
    return (best, float(finite.index(best))) if best >= 0 else (-1.0, 0.0)


def _constant(values: tuple[float, ...], device) -> torch.Tensor:
    """A small constant float32 vector on `device`, made once (read only: `torch.cat` copies it)."""
    key = (values, str(device))
    out = _CONSTANTS.get(key)
    if out is None:
        out = _CONSTANTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return out


class GradRows:
    """Mixin of `GradStats` (which provides `engine`, `_sources`, `_group_names`, `_ensure_entries`, `_present`,
    `_param_max_abs`, `_dev_key` and the step's rank-agreed `_agreed_*` state it initialises and resets)."""

    def _extras(self, device) -> tuple[list[str], list[torch.Tensor], list[float]]:
        """(keys, the device values as one-element vectors for the row's one `cat`, the host values) of the sources'
        scalars. A source may give a host number (a count it already has on the host): in one process it ends the row
        as it is (its key after the device values'), with no tensor made for it - making one is the costliest op of the
        row; distributed, it goes into the vector in the sources' order, which is the same on every rank whichever
        values a rank holds on the host."""
        keys, vals, host_keys, host = [], [], [], []
        hold = not is_distributed()
        for fn in self._sources.values():
            for k, v in (fn() or {}).items():
                if isinstance(v, (int, float)):
                    if hold:
                        host_keys.append(k)
                        host.append(float(v))
                        continue
                    v = torch.tensor(float(v), dtype=torch.float32, device=device)
                keys.append(k)
                v = v.to(device=device, dtype=torch.float32)  # (the same tensor when it is already: no op)
                v = v.detach() if v.requires_grad else v
                vals.append(v.reshape(1))
        return keys + host_keys, vals, host

    @staticmethod
    def _best(values: torch.Tensor) -> torch.Tensor:
        """[largest finite value, its index] (value -1 when none is finite), as one 2-element tensor."""
        best = torch.max(torch.nan_to_num(values, nan=-1.0, posinf=-1.0, neginf=-1.0), dim=0)
        return torch.stack([best.values.float(), best.indices.float()])

    # Layout of one rank's row: group norms [G], non-finite counts [G], then _TAIL named slots, one value per statistics
    # tensor (`_local_vector`), then the extras (the sources' device values, then their host values).
    _TAIL = ("global", "top_norm", "top_arg", "available", "has_max", "max_abs", "max_arg")

    def _slot(self, name: str) -> int:
        return 2 * len(self._group_names) + self._TAIL.index(name)

    def _extras_at(self) -> int:
        """Where the extras start in a row."""
        return 2 * len(self._group_names) + len(self._TAIL) + len(self._ensure_entries())

    @staticmethod
    def _max_part(dev: DeviceGradStats | None, per_tensor: torch.Tensor | None, device) -> torch.Tensor:
        """[has_max, max |g|, its index] of this rank (has_max 0 when the gradients were dropped)."""
        if dev is None or per_tensor is None:
            return _constant((0.0, -1.0, 0.0), device)
        return torch.cat([_constant((1.0,), device), GradRows._best(per_tensor)])

    def _local_vector(self, dev: DeviceGradStats | None, max_abs: bool, reuse_extras: bool = False):
        """(extras keys, this rank's vector, the host values that end its row); `reuse_extras` takes this rank's extras
        from the step's gathered row (the loss does not change when a gradient is edited, and its sources are read once
        per step).

        After the named slots comes one value per statistics tensor, in entry order: its squared norm under a sharded
        engine (summed over ranks in the report), else its norm (-1 without a gradient), from which the report finds
        the largest finite one on the host (`top_of`) - cheaper than finding it on the device."""
        entries = self._ensure_entries()
        n_groups = len(self._group_names)
        device = dev.global_norm.device if dev is not None else next((p.device for _, p, _ in entries), "cpu")
        sharded = self.engine.sharded
        per_tensor = self._param_max_abs(dev) if (max_abs and dev is not None) else None
        if dev is None:
            head = torch.zeros(2 * n_groups + 4, device=device)
            head[2 * n_groups + 1] = -1.0  # no finite top norm
            parts = [head, self._max_part(None, None, device)]
        else:  # (one cat for the whole vector below: each small op costs more than its arithmetic on CPU)
            # unsharded, the non-finite counts are the host's (`_nonfinite_counts`): zeros hold their places
            nonfinite = dev.nonfinite if dev.nonfinite is not None else _constant((0.0,) * n_groups, device)
            parts = [dev.group_norms, nonfinite, dev.global_norm.reshape(1)]
            if sharded:
                parts += [self._best(dev.param_norms), _constant((1.0,), device)]
            elif per_tensor is None:  # top norm / index found on the host; available; no max |g|
                parts.append(_constant((-1.0, 0.0, 1.0, 0.0, -1.0, 0.0), device))
                per_tensor = False
            else:
                parts.append(_constant((-1.0, 0.0, 1.0), device))
            if per_tensor is not False:
                parts.append(self._max_part(dev, per_tensor, device))
        # sharded: each rank holds part of every tensor, its squared norms are summed over ranks
        parts.append(self._tensor_norms(dev, len(entries), device, squared=sharded))
        if reuse_extras:
            first = self._extras_at()
            keys, host = self._agreed_keys, self._agreed_rows[rank()][first : first + len(self._agreed_keys)]
        else:
            keys, extras, host = self._extras(device)
            parts += extras
        return keys, torch.cat(parts), host

    def _tensor_norms(self, dev: DeviceGradStats | None, n: int, device, squared: bool = False) -> torch.Tensor:
        """This rank's norm (or squared norm) of every statistics tensor, in entry order; where it has no gradient -1
        (a squared norm: 0, a part that adds nothing over ranks)."""
        values = None if dev is None else dev.param_norms.to(device)
        values = values.square() if squared and values is not None else values
        if values is not None and len(dev.names) == n:
            return values
        out = torch.full((n,), 0.0 if squared else -1.0, device=device)
        if values is None:
            return out
        at = {name: i for i, name in enumerate(self._entry_names())}
        index = torch.tensor([at[name] for name in dev.names], dtype=torch.long, device=device)
        return out.index_copy_(0, index, values)

    def _tensor_reads(self, norms: list[float], n_groups: int) -> tuple[tuple[float, float], list[int]]:
        """(`top_of`, `_nonfinite_counts`) of a rank's per-tensor norms; when every one is finite (their sum is: the
        usual step) without a Python loop over them."""
        if sum(norms) < math.inf:
            best = max(norms, default=-1.0)
            return ((best, float(norms.index(best))) if best >= 0 else (-1.0, 0.0)), [0] * n_groups
        return top_of(norms), self._nonfinite_counts(norms, n_groups)

    def _nonfinite_counts(self, norms: list[float], n_groups: int) -> list[int]:
        """Per group, how many of a rank's per-tensor norms are not finite (a tensor holding NaN/Inf; -1, a tensor
        without a gradient, is finite)."""
        counts = [0] * n_groups
        for i, v in enumerate(norms):
            if not v < math.inf:  # inf or NaN (a norm is never -inf)
                counts[self._entries[i][2]] += 1
        return counts

    def _tensor_name(self, dev: DeviceGradStats, index: int) -> str | None:
        """The name of entry `index` of the per-tensor norms (`dev.names` when every tensor has a gradient)."""
        names = dev.names if len(dev.names) == len(self._ensure_entries()) else self._entry_names()
        return names[index] if 0 <= index < len(names) else None

    def _entry_names(self) -> list[str]:
        return [name for name, _, _ in self._ensure_entries()]

    def _needs_gather(self, step, max_abs: bool) -> bool:
        """Whether this call enters the collective - decided only from rank-agreed state (the step label and what
        earlier calls of this step gathered), never from this rank's gradient cache."""
        if step is None or self._agreed_step != step or self._agreed_rows is None:
            return True
        available = all(row[self._slot("available")] > 0.5 for row in self._agreed_rows)
        return max_abs and available and not self._agreed_max

    def _gather(self, dev: DeviceGradStats | None, step, max_abs: bool) -> None:
        """The step's collective: every rank's vector (or, later in the step, only its max |g| slots)."""
        if step is not None and self._agreed_step == step and self._agreed_rows is not None:
            # the step's report exists; add the exact max |g| (one more transfer and collective)
            device = dev.global_norm.device if dev is not None else torch.device("cpu")
            part = self._max_part(dev, self._param_max_abs(dev) if dev is not None else None, device)
            start = self._slot("has_max")
            for row, values in zip(self._agreed_rows, all_gather_tensor(part).tolist(), strict=False):
                row[start : start + 3] = values
        else:
            keys, vector, host = self._local_vector(dev, max_abs)
            self._agreed_rows = all_gather_lists(vector, host)  # the single device→host transfer
            self.row_gathers += 1
            self._agreed_keys, self._agreed_step, self._agreed_dev_key = keys, step, self._dev_key
        self._agreed_max = max_abs

    def _refresh_own_row(self, dev: DeviceGradStats | None, step) -> bool:
        """This rank's gradients were edited since the step's rows were gathered (a callback between two of ours, a
        fault): replace this rank's row with the fresh numbers, without a collective. Its report then differs from
        the other ranks' (the edit makes this rank's gradients differ: `ranks_differ`), and the skip guard gathers the
        rows again, so every rank judges the edit. Returns whether the row changed."""
        if self._agreed_step != step or self._agreed_rows is None or self._agreed_dev_key is self._dev_key:
            return False
        _, vector, host = self._local_vector(dev, self._agreed_max, reuse_extras=True)
        self._agreed_rows[rank()] = vector.tolist() + host
        self._agreed_dev_key = self._dev_key
        return True

    def agreed_extras(self, step) -> dict[str, float] | None:
        """The sources' scalars (the loss, ...) of step `step` summed over ranks, from the rows the step has gathered;
        None before its first gather (then `compute`). They do not depend on the gradients, so none is checked here;
        whether the rows exist is rank-agreed."""
        if step is None or self._agreed_step != step or self._agreed_rows is None:
            return None
        return self._row_extras()

    def _row_extras(self) -> dict[str, float]:
        first = self._extras_at()
        return {k: sum(row[first + j] for row in self._agreed_rows) for j, k in enumerate(self._agreed_keys)}

    def _report(self, dev: DeviceGradStats | None, step) -> GradReport:
        """The report from the gathered rows: sums of the extras, the worst rank of every statistic (sharded
        engines: the sums of the ranks' parts)."""
        if self.engine.sharded:
            return self._sharded_report(dev, step)
        rows, n_groups = self._agreed_rows, len(self._group_names)
        col = {name: self._slot(name) for name in self._TAIL}
        extras = self._row_extras()
        rank_norms = [row[col["global"]] for row in rows]
        missing = [r for r, row in enumerate(rows) if row[col["available"]] < 0.5]
        if dev is None or missing:  # (this rank is among `missing` when dev is None)
            everywhere = len(missing) == len(rows)  # then every rank gives the same local reason
            reason = self._unavailable_reason() if everywhere else f"rank {missing[0]} has no gradient to read"
            return GradReport(step=step, available=False, reason=reason, extras=extras, rank_norms=rank_norms)
        present = sorted(set(dev.group_ids))
        first, end = 2 * n_groups + len(self._TAIL), self._extras_at()  # the per-tensor norms (`_local_vector`)
        tops, counts = zip(*(self._tensor_reads(row[first:end], n_groups) for row in rows), strict=True)
        top_norm, top_arg = _best_rank(list(tops))
        if len(rows) == 1:  # one rank: each statistic is its own worst
            (row,), (count,) = rows, counts
            group_norms = {dev.groups[g]: row[g] for g in present}
            nonfinite = {dev.groups[g]: count[g] for g in present}
        else:
            group_norms = {dev.groups[g]: _worst([row[g] for row in rows]) for g in present}
            nonfinite = {dev.groups[g]: max(count[g] for count in counts) for g in present}
        report = GradReport(
            step=step,
            available=True,
            global_norm=_worst(rank_norms),
            group_norms=group_norms,
            nonfinite=nonfinite,
            max_param_norm=top_norm if top_norm >= 0 else math.nan,
            max_norm_param=self._tensor_name(dev, int(top_arg)) if top_norm >= 0 else None,
            n_tensors=len(dev.names),
            extras=extras,
            rank_norms=rank_norms,
        )
        if self._agreed_max:
            fill_max_abs(report, rows, col, dev)
        return report

    def _sharded_report(self, dev: DeviceGradStats | None, step) -> GradReport:
        """The report when every rank holds a part of each gradient (`grad_combine.sharded_report`)."""
        col = {name: self._slot(name) for name in self._TAIL}
        return sharded_report(
            self._agreed_rows,
            col,
            self._group_names,
            self._agreed_keys,
            self._entry_names(),
            sorted({gi for _, _, gi in self._ensure_entries()}),
            dev,
            step,
            self._agreed_max,
            self._unavailable_reason,
        )

    def _unavailable_reason(self) -> str:
        _, grads, _ = self._present()
        return "sharded (DTensor) gradients are not read" if grads else "no parameter has a .grad"
