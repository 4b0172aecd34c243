"""Config section for the stability guards: callbacks that act (skip, rollback, clipping, LR and batch control).

Each guard has its own sub-section with an `enabled` switch; `guards.enabled: false` switches all of them off.
The recipe defaults are skip + rollback + adaptive clipping on; SNR LR control, optimizer phases, batch-size
warmup and the thermal guard are opt-in. See `hf_stable/callbacks/guards/` for what each one does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_stable.config.fields import check_positive, check_unit_interval
from hf_stable.config.fields import help_ as _h
from hf_stable.config.step_guards import RollbackConfig, SkipConfig


@dataclass
class LRControlConfig:
    """Persistent LR factors (rollback backoff, SNR, batch warmup, thermal) multiplied onto the scheduler's LR."""

    min_factor: float = field(default=1e-3, metadata=_h("The product of all LR factors never goes below this."))
    max_factor: float = field(default=10.0, metadata=_h("... nor above this."))

    def validate(self) -> list[str]:
        out: list[str] = []
        check_positive(self, ("min_factor", "max_factor"), out)
        if not out and self.min_factor > self.max_factor:
            out.append(f"min_factor: got {self.min_factor}, must be <= max_factor ({self.max_factor})")
        return out


DEFAULT_GROUP_MAX_NORM = {"embeddings": 0.3, "layer": 0.8, "norm": 0.8, "lm_head": 0.5, "other": 1.0}


def _default_group_max_norm() -> dict[str, float]:
    return dict(DEFAULT_GROUP_MAX_NORM)


@dataclass
class ClippingConfig:
    """Gradient clipping owned by hf_stable (the recipe sets TrainingArguments.max_grad_norm=0).

    Modes: `global` (one max norm, like the Trainer's), `per_group` (a max norm per parameter site),
    `adaptive` (per group, ZClip-style z-score on an EMA of the group's norm; `max_norm` stays an outer cap).
    """

    enabled: bool = field(default=True, metadata=_h("Clip gradients in a guard."))
    mode: Literal["global", "per_group", "adaptive"] = field(default="adaptive", metadata=_h("Clipping mode."))
    max_norm: float | None = field(
        default=1.0,
        metadata=_h(
            "global: the max global norm. adaptive: an outer global cap and the rule during warm-up. "
            "null = none (not allowed in global mode)."
        ),
    )
    group_max_norm: dict[str, float] = field(
        default_factory=_default_group_max_norm,
        metadata=_h(
            "per_group: max norm per site (embeddings, layer, norm, lm_head, other); each decoder layer "
            "and each LoRA A/B group of a layer is clipped on its own."
        ),
    )
    ema_alpha: float = field(default=0.97, metadata=_h("adaptive: EMA decay of each group's norm mean/variance."))
    z_threshold: float = field(default=2.5, metadata=_h("adaptive: clip a group to mean + z * std above this z."))
    warmup_steps: int = field(default=25, metadata=_h("adaptive: steps of statistics before z-clipping starts."))
    agc_lambda: float | None = field(
        default=None, metadata=_h("Unit-wise adaptive gradient clipping: |g_row| <= lambda * |w_row|. null = off.")
    )
    agc_eps: float = field(default=1e-3, metadata=_h("AGC: weight-row norms below this count as this."))

    def validate(self) -> list[str]:
        out: list[str] = []
        check_positive(self, ("max_norm", "z_threshold", "agc_lambda", "agc_eps"), out)
        check_unit_interval(self, ("ema_alpha",), out)
        if self.mode == "global" and self.max_norm is None:
            out.append("max_norm: got null, global mode needs a number")
        allowed = set(DEFAULT_GROUP_MAX_NORM)
        for key, value in self.group_max_norm.items():
            if key not in allowed:
                out.append(f"group_max_norm.{key}: unknown site (allowed: {', '.join(sorted(allowed))})")
            elif not value > 0:
                out.append(f"group_max_norm.{key}: got {value}, must be > 0")
        if self.warmup_steps < 2:
            out.append(f"warmup_steps: got {self.warmup_steps}, must be >= 2")
        return out


@dataclass
class SNRConfig:
    """SNR LR control: every `interval` steps compare the grad norm with its EMA and nudge a persistent LR factor."""

    enabled: bool = field(default=False, metadata=_h("Adjust the LR from the grad-norm signal."))
    interval: int = field(default=100, metadata=_h("Steps between adjustments."))
    ema_beta: float = field(default=0.95, metadata=_h("EMA decay of the reference grad norm."))
    current_window: int = field(
        default=10, metadata=_h("The 'current' norm is the mean of the last N steps (1 = the literal last step).")
    )
    high_ratio: float = field(
        default=1.5,
        metadata=_h("current / EMA above this (far outside the band: healthy runs stay within 0.86-1.23) ..."),
    )
    decrease: float = field(default=0.8, metadata=_h("... multiplies the LR factor by this."))
    recover_ratio: float = field(
        default=1.1,
        metadata=_h("With the factor below 1, current / EMA below this (back in band) multiplies it by `increase`."),
    )
    low_ratio: float = field(default=0.7, metadata=_h("current / EMA below this ..."))
    increase: float = field(default=1.1, metadata=_h("... multiplies the LR factor by this (up to max_factor)."))
    min_factor: float = field(default=0.1, metadata=_h("The SNR factor is clamped to [min_factor, max_factor]."))
    max_factor: float = field(
        default=1.0, metadata=_h("Upper clamp of the SNR factor (1 = never above the scheduled LR).")
    )

    def validate(self) -> list[str]:
        out: list[str] = []
        if self.interval < 1 or self.current_window < 1:
            out.append(f"interval: got {self.interval} (current_window {self.current_window}), both must be >= 1")
        check_unit_interval(self, ("ema_beta",), out)
        if not 0 < self.low_ratio < 1 < self.high_ratio:
            out.append(f"low_ratio/high_ratio: got {self.low_ratio}/{self.high_ratio}, need 0 < low < 1 < high")
        if not self.low_ratio <= self.recover_ratio < self.high_ratio:
            out.append(
                f"recover_ratio: got {self.recover_ratio}, need low_ratio ({self.low_ratio}) <= recover_ratio < "
                f"high_ratio ({self.high_ratio})"
            )
        if not 0 < self.decrease < 1 < self.increase:
            out.append(f"decrease/increase: got {self.decrease}/{self.increase}, need 0 < decrease < 1 < increase")
        if not 0 < self.min_factor <= 1 <= self.max_factor:
            out.append(f"min_factor/max_factor: got {self.min_factor}/{self.max_factor}, need 0 < min <= 1 <= max")
        return out


@dataclass
class PhaseConfig:
    """One optimizer phase: which optimizer, until when, at which LR scale."""

    name: Literal["adamw", "sgd", "lion"] = field(default="adamw", metadata=_h("Optimizer of this phase."))
    until_step: int | None = field(default=None, metadata=_h("Switch to the next phase at this optimizer step."))
    until_dloss_below: float | None = field(
        default=None, metadata=_h("... or when the EMA of |loss[t] - loss[t-1]| falls below this.")
    )
    lr_scale: float = field(default=1.0, metadata=_h("LR factor while this phase runs (Lion ~0.3, SGD larger)."))

    def validate(self) -> list[str]:
        out: list[str] = []
        check_positive(self, ("until_step", "until_dloss_below", "lr_scale"), out)
        return out


def _default_phases() -> list[PhaseConfig]:
    return [
        PhaseConfig("adamw", until_step=500),
        PhaseConfig("sgd", until_step=2000, lr_scale=10.0),
        PhaseConfig("lion", lr_scale=0.3),
    ]


@dataclass
class OptimizerPhasesConfig:
    """Switch optimizers mid-run (opt-in); the new one keeps the factory's groups and LR multipliers."""

    enabled: bool = field(default=False, metadata=_h("Run optimizer phases."))
    phases: list[PhaseConfig] = field(default_factory=_default_phases, metadata=_h("The phases, in order."))
    state_policy: Literal["reset", "carry_momentum"] = field(
        default="carry_momentum",
        metadata=_h(
            "At a switch: reset = fresh state; carry_momentum = the first moment (AdamW exp_avg, Lion "
            "exp_avg, SGD momentum as an average) seeds the next optimizer's momentum."
        ),
    )
    dloss_ema_beta: float = field(default=0.98, metadata=_h("EMA decay of |dloss| for until_dloss_below."))

    def validate(self) -> list[str]:
        out: list[str] = []
        check_unit_interval(self, ("dloss_ema_beta",), out)
        if self.enabled and not self.phases:
            out.append("phases: got an empty list, need at least one phase")
        last = 0
        for i, phase in enumerate(self.phases):
            if i < len(self.phases) - 1 and phase.until_step is None and phase.until_dloss_below is None:
                out.append(f"phases[{i}]: needs until_step or until_dloss_below (only the last phase runs to the end)")
            if phase.until_step is not None:
                if phase.until_step <= last:
                    out.append(f"phases[{i}].until_step: got {phase.until_step}, must be > {last}")
                last = phase.until_step
        return out


@dataclass
class BatchWarmupConfig:
    """Batch-size warmup through gradient accumulation: start small, double every N steps to the target."""

    enabled: bool = field(default=False, metadata=_h("Grow the effective batch during the first steps."))
    initial_accumulation: int = field(default=1, metadata=_h("Micro-batches per optimizer step at the start."))
    double_every: int = field(default=100, metadata=_h("Double the accumulation every N optimizer steps."))
    target_accumulation: int | None = field(
        default=None, metadata=_h("Final accumulation; null = training.gradient_accumulation_steps.")
    )
    lr_rule: Literal["sqrt", "linear", "none"] = field(
        default="sqrt", metadata=_h("LR compensation for the smaller batch: lr x (b/target)^0.5 or ^1.")
    )

    def validate(self) -> list[str]:
        out: list[str] = []
        if self.initial_accumulation < 1 or self.double_every < 1:
            out.append(
                f"initial_accumulation/double_every: got {self.initial_accumulation}/{self.double_every}, "
                "both must be >= 1"
            )
        if self.target_accumulation is not None and self.target_accumulation < self.initial_accumulation:
            out.append(f"target_accumulation: got {self.target_accumulation}, must be >= initial_accumulation")
        return out


@dataclass
class ThermalConfig:
    """Thermal guard: a hot GPU gets a smaller accumulation (8 -> 6) and LR x 6/8; restored when cool. No-op
    without NVML."""

    enabled: bool = field(default=False, metadata=_h("Lower the load while the GPU is hot."))
    hot_c: float = field(default=75.0, metadata=_h("At or above this temperature (C, hottest rank) ..."))
    hot_ratio: float = field(default=0.75, metadata=_h("... accumulation x this (8 -> 6) ..."))
    cool_c: float = field(default=70.0, metadata=_h("... until the temperature is below this."))
    check_every: int = field(default=10, metadata=_h("Read the temperature every N optimizer steps."))
    lr_rule: Literal["sqrt", "linear", "none"] = field(
        default="linear", metadata=_h("LR compensation for the smaller batch (linear: LR x 6/8).")
    )

    def validate(self) -> list[str]:
        out: list[str] = []
        if not self.cool_c < self.hot_c:
            out.append(f"cool_c: got {self.cool_c}, must be < hot_c ({self.hot_c})")
        check_unit_interval(self, ("hot_ratio",), out)
        if self.check_every < 1:
            out.append(f"check_every: got {self.check_every}, must be >= 1")
        return out


@dataclass
class GuardsConfig:
    """Callbacks that act: skip, rollback, clipping, LR control, optimizer phases, batch warmup, thermal."""

    enabled: bool = field(default=True, metadata=_h("Master switch for every guard."))
    lr: LRControlConfig = field(default_factory=LRControlConfig, metadata=_h("Persistent LR factors."))
    skip: SkipConfig = field(default_factory=SkipConfig, metadata=_h("Skip bad steps."))
    rollback: RollbackConfig = field(default_factory=RollbackConfig, metadata=_h("Roll back after bad steps."))
    clipping: ClippingConfig = field(default_factory=ClippingConfig, metadata=_h("Gradient clipping."))
    snr: SNRConfig = field(default_factory=SNRConfig, metadata=_h("SNR LR control."))
    phases: OptimizerPhasesConfig = field(default_factory=OptimizerPhasesConfig, metadata=_h("Optimizer phases."))
    batch_warmup: BatchWarmupConfig = field(default_factory=BatchWarmupConfig, metadata=_h("Batch-size warmup."))
    thermal: ThermalConfig = field(default_factory=ThermalConfig, metadata=_h("Thermal guard."))

    def validate(self) -> list[str]:
        out: list[str] = []
        if self.rollback.enabled and not self.skip.enabled:
            out.append("rollback.enabled: true needs skip.enabled: true (the skip guard judges bad steps)")
        if self.batch_warmup.enabled and self.thermal.enabled and self.batch_warmup.lr_rule != self.thermal.lr_rule:
            out.append(
                f"thermal.lr_rule: got {self.thermal.lr_rule!r}, must equal batch_warmup.lr_rule "
                f"({self.batch_warmup.lr_rule!r}) when both change the accumulation"
            )
        return out
