"""Config section for `hf-stable doctor`: what the preflight checks run and the thresholds they use."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_stable.config.fields import help_ as _h

# Model families whose activations are known to exceed fp16's range (max 65504) in fine-tuning or inference;
# their checkpoints were trained in bf16 and their authors recommend bf16 (Gemma, Qwen2/2.5/3, T5).
FP16_OVERFLOW_FAMILIES = ["gemma", "gemma2", "gemma3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "t5", "mt5"]


@dataclass
class DoctorConfig:
    """Preflight checks run by `hf-stable doctor` and, with `doctor: true`, by the recipe before training.

    Example:
        >>> DoctorConfig(dry_run_steps=5, grad_cv_max=0.5).validate()
        []
    """

    dry_run: bool = field(default=True, metadata=_h("Run a few real optimizer steps (weights restored after)."))
    dry_run_steps: int = field(default=10, metadata=_h("Optimizer steps of the dry run (per-group grad statistics)."))
    memory_probe: bool = field(
        default=True, metadata=_h("Measure memory at micro-batch b and 2b (GPU: peak; CPU: RSS growth).")
    )
    allow_blocking: bool = field(
        default=False, metadata=_h("Start training even when the doctor reports an error (blocking) finding.")
    )
    grad_mean_min: float = field(
        default=1e-4,
        metadata=_h("Warn when a group's mean grad norm (over dry_run_steps batches at fixed weights) is below this."),
    )
    grad_cv_max: float = field(
        default=0.3, metadata=_h("Warn when a group's grad-norm std across those batches exceeds this x its mean.")
    )
    memory_linear_tolerance: float = field(
        default=0.25, metadata=_h("Activation memory at 2b within 2x(1 +/- this) of b's counts as linear.")
    )
    memory_headroom: float = field(
        default=0.9, metadata=_h("Fraction of GPU memory the largest-micro-batch estimate may use.")
    )
    temperature_warn_c: float = field(default=80.0, metadata=_h("Warn when an idle GPU is already this hot (C)."))
    fp16_overflow_families: list[str] = field(
        default_factory=lambda: list(FP16_OVERFLOW_FAMILIES),
        metadata=_h("config.model_type values known to overflow in fp16 (recommend bf16)."),
    )
    memory_budget_gib: float | None = field(
        default=None,
        metadata=_h(
            "Memory of the device the recipe is for (GiB), against which the memory estimate is judged (times "
            "memory_headroom). null = GPU 0's memory, or the host's available memory without a GPU."
        ),
    )
    reference_batch: int | None = field(
        default=None,
        metadata=_h(
            "Effective batch the learning rate was tuned at; when the run's effective batch differs, the doctor "
            "suggests the rescaled LR (sqrt rule for AdamW/Lion, linear for SGD)."
        ),
    )

    def validate(self) -> list[str]:
        problems = []
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            problems.append(f"memory_budget_gib: got {self.memory_budget_gib}, must be > 0 (or null)")
        if self.dry_run_steps < 1:
            problems.append(f"dry_run_steps: got {self.dry_run_steps}, must be >= 1")
        for name in ("grad_mean_min", "grad_cv_max", "memory_linear_tolerance"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}: got {getattr(self, name)}, must be > 0")
        if not 0 < self.memory_headroom <= 1:
            problems.append(f"memory_headroom: got {self.memory_headroom}, must be in (0, 1]")
        if self.reference_batch is not None and self.reference_batch < 1:
            problems.append(f"reference_batch: got {self.reference_batch}, must be >= 1 or null")
        return problems
