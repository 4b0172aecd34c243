"""The optimizer group table the recipe prints and saves at start: what each group trains, at which LR and decay.

It is the cheapest way to catch a grouping mistake (a layer at the wrong LR, LoRA B without its ratio, decay on
norms) before hours of training, and the saved JSON documents the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_COLUMNS = ("name", "tensors", "parameters", "lr", "weight_decay")


def group_table(optimizer: torch.optim.Optimizer) -> list[dict]:
    """One row per param group: name, tensors, parameters (element count), lr, weight_decay.

    `lr` is the group's configured LR (`initial_lr` once a scheduler has started), not the current scheduled value.
    """
    rows = []
    runs = optimizer_class(optimizer)
    for i, group in enumerate(optimizer.param_groups):
        rows.append(
            {
                "name": group.get("name", f"group_{i}"),
                "optimizer": runs,
                "tensors": len(group["params"]),
                "parameters": sum(p.numel() for p in group["params"]),
                "lr": float(group.get("initial_lr", group["lr"])),
                "weight_decay": float(group.get("weight_decay", 0.0)),
            }
        )
    return rows


def optimizer_class(optimizer) -> str:
    """The class that really steps, with its package: "torch.optim.AdamW", "bitsandbytes.optim.PagedAdamW8bit";
    a phased optimizer names its phases' classes in order."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    names = getattr(inner, "names", None)
    if isinstance(names, list) and hasattr(inner, "current"):  # a PhasedOptimizer: phase 0 runs first
        return f"{optimizer_class(inner.current)} (phases: {' -> '.join(names)})"
    cls = type(inner)
    if cls.__name__ == "FusedAdamW" and cls.__module__.startswith("hf_stable"):
        return "torch.optim.AdamW (fused kernel, every group in one pass: hf_stable.optim.FusedAdamW)"
    module = cls.__module__.split(".")
    package = ".".join(module[:2]) if module[0] in ("torch", "bitsandbytes") else module[0]
    return f"{package}.{cls.__name__}"


def format_group_table(rows: list[dict]) -> str:
    """An aligned text table of `group_table` rows with a total line (and, first, the optimizer class)."""
    cells = [list(_COLUMNS)]
    for r in rows:
        lr, wd = f"{r['lr']:.3g}", f"{r['weight_decay']:g}"
        cells.append([r["name"], str(r["tensors"]), f"{r['parameters']:,}", lr, wd])
    total_t = sum(r["tensors"] for r in rows)
    total_p = sum(r["parameters"] for r in rows)
    cells.append([f"total ({len(rows)} groups)", str(total_t), f"{total_p:,}", "", ""])
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = []
    for n, row in enumerate(cells):
        left = row[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=False))
        lines.append(f"{left}  {rest}".rstrip())
        if n == 0 or n == len(cells) - 2:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    runs = rows[0].get("optimizer") if rows else None
    return "\n".join([f"optimizer: {runs}", *lines] if runs else lines)


def save_group_table(optimizer: torch.optim.Optimizer, path: str | Path) -> list[dict]:
    """Write `group_table(optimizer)` as JSON to `path` (parent directories created) and return the rows."""
    rows = group_table(optimizer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return rows
