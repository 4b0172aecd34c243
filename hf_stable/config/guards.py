"""Config section for the stability guards (callbacks that act: skip, rollback, clipping, LR control)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GuardsConfig:
    """Callbacks that act (skip, rollback, clipping, LR control)."""

    enabled: bool = field(default=True, metadata={"help": "Master switch for every guard."})
