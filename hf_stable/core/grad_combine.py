"""How `GradStats` combines the ranks' gathered vectors into one report: the worst rank of each statistic under DDP
(the ranks' gradients are the same after the all-reduce), the sums of the ranks' parts under sharded engines (FSDP2
shards, ZeRO partitions). Pure functions of the gathered rows (host numbers); no collective here."""

from __future__ import annotations

import math
from collections.abc import Callable

from hf_stable.core.grad_report import DeviceGradStats, GradReport


def worst(values: list[float]) -> float:
    """The worst of the ranks' values: NaN over +inf over the largest finite value."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def best_rank(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(value, index) of the rank with the largest value (the lowest rank on a tie)."""
    return max(pairs, key=lambda pair: pair[0])


def param_name(dev: DeviceGradStats, arg: float) -> str | None:
    index = int(arg)
    return dev.names[index] if 0 <= index < len(dev.names) else None


def fill_max_abs(report: GradReport, rows: list[list[float]], col: dict[str, int], dev: DeviceGradStats) -> None:
    """The exact max |g| (and where) into `report` when every rank gathered it: the largest rank's value."""
    if not all(row[col["has_max"]] > 0.5 for row in rows):
        return
    value, arg = best_rank([(row[col["max_abs"]], row[col["max_arg"]]) for row in rows])
    report.has_max_abs = True
    if value >= 0:  # else every gradient is non-finite: there is no finite maximum (stays NaN / None)
        report.max_abs, report.max_abs_param = value, param_name(dev, arg)
        index = int(arg)
        report.max_abs_group = dev.groups[dev.group_ids[index]] if index < len(dev.group_ids) else None


def sharded_report(
    rows: list[list[float]],
    col: dict[str, int],
    group_names: list[str],
    keys: list[str],
    names: list[str],
    present: list[int],
    dev: DeviceGradStats | None,
    step,
    with_max: bool,
    unavailable_reason: Callable[[], str],
) -> GradReport:
    """Every rank holds a part of each gradient: a norm is the root of the summed squares of the parts, a tensor is
    non-finite when a part of it is on some rank, max |g| is the largest part.

    A row is [group norms G, non-finite counts G, the tail slots `col`, squared norm per tensor, the extras `keys`].
    """
    n_groups = len(group_names)
    first = 2 * n_groups + len(col)
    at = first + len(names)
    extras = {k: sum(row[at + j] for row in rows) for j, k in enumerate(keys)}
    rank_norms = [row[col["global"]] for row in rows]
    if dev is None or any(row[col["available"]] < 0.5 for row in rows):
        everywhere = all(row[col["available"]] < 0.5 for row in rows)
        reason = unavailable_reason() if everywhere else "a rank has no gradient to read"
        return GradReport(
            step=step, available=False, reason=reason, extras=extras, rank_norms=rank_norms, sharded=True
        )
    squares = [sum(row[first + i] for row in rows) for i in range(len(names))]
    norms = [math.sqrt(v) if math.isfinite(v) else math.nan for v in squares]
    finite = [(v, i) for i, v in enumerate(norms) if math.isfinite(v)]
    top_norm, top = max(finite) if finite else (-1.0, 0)
    group_sq = {g: sum(row[g] ** 2 for row in rows) for g in present}
    total = sum(group_sq.values())
    report = GradReport(
        step=step,
        available=True,
        global_norm=math.sqrt(total) if math.isfinite(total) else math.nan,
        group_norms={group_names[g]: math.sqrt(v) if math.isfinite(v) else math.nan for g, v in group_sq.items()},
        nonfinite={group_names[g]: int(max(row[n_groups + g] for row in rows)) for g in present},
        max_param_norm=top_norm if top_norm >= 0 else math.nan,
        max_norm_param=names[top] if top_norm >= 0 else None,
        n_tensors=len(names),
        extras=extras,
        rank_norms=rank_norms,
        sharded=True,
    )
    if with_max:
        fill_max_abs(report, rows, col, dev)
    return report
