"""Config sections for the stability monitors and guards."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MonitorsConfig:
    """Read-only callbacks (gradient health, loss dynamics, memory, throughput, hardware)."""

    enabled: bool = field(default=True, metadata={"help": "Master switch for every monitor."})


@dataclass
class GuardsConfig:
    """Callbacks that act (skip, rollback, clipping, LR control)."""

    enabled: bool = field(default=True, metadata={"help": "Master switch for every guard."})


@dataclass
class StabilityConfig:
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
