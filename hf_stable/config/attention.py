"""Config section for the attention implementation, its soft-cap, logit monitor and QK-clip."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# the name hf_stable registers its attention function under (`attn_implementation="hf_stable"`)
ATTN_IMPLEMENTATION = "hf_stable"

BACKENDS = ("auto", "flash", "sdpa", "eager")


def kernel_problems(backend: str, softcap: float | None) -> list[str]:
    """What is wrong with a backend / soft-cap pair (shared by `AttentionConfig` and `AttentionSettings`)."""
    problems = []
    if backend not in BACKENDS:
        problems.append(f"backend: got {backend!r}, allowed: {', '.join(BACKENDS)}")
    if softcap is not None and not softcap > 0:
        problems.append(f"softcap: got {softcap!r}, must be > 0 or null (off)")
    if softcap is not None and backend == "sdpa":
        problems.append("backend: got 'sdpa', SDPA cannot soft-cap; use 'auto' or 'eager', or softcap: null")
    return problems


@dataclass
class AttentionConfig:
    """Which attention implementation the model uses, and hf_stable's attention extras.

    Soft-cap, monitor and QK-clip need `implementation: hf_stable` (the recipe registers it first).
    """

    implementation: str = field(
        default=ATTN_IMPLEMENTATION,
        metadata={"help": "'hf_stable', or any transformers implementation (sdpa, eager, ...)."},
    )
    backend: Literal["auto", "flash", "sdpa", "eager"] = field(
        default="auto",
        metadata={
            "help": "hf_stable only. auto: flash-attn 2 on CUDA fp16/bf16 when installed, else SDPA (explicit "
            "fp32 softmax when soft-capping); or force flash / sdpa / eager (explicit path)."
        },
    )
    softcap: float | None = field(
        default=None,
        metadata={
            "help": "Soft-cap attention logits to cap*tanh(s/cap) before the softmax; null = off, 50.0 is usual."
        },
    )
    monitor_interval: int = field(
        default=10,
        metadata={
            "help": "Sample the per-layer max attention logit every N optimizer steps (and at step 1); "
            "logged as attn/max_logit/layer_<i>. 0 = off."
        },
    )
    logit_alert_threshold: float = field(
        default=100.0,
        metadata={
            "help": "Alert when a layer's sampled max attention logit goes above this level (with a softcap, the "
            "softcap when lower): a softmax row that saturates. Healthy runs sit at 7-35."
        },
    )
    logit_growth_checks: int = field(
        default=5,
        metadata={"help": "Alert when a layer's max logit rose at this many consecutive samples ..."},
    )
    logit_growth_ratio: float = field(
        default=1.5, metadata={"help": "... and grew by at least this factor over them ..."}
    )
    logit_growth_min_share: float = field(
        default=0.5,
        metadata={
            "help": "... to at least this share of the alert level (approaching saturation; a rise from 20 to 35 "
            "is ordinary)."
        },
    )
    qk_clip: bool = field(
        default=False,
        metadata={"help": "After an optimizer step, rescale q/k weights per head of layers whose max logit > tau."},
    )
    qk_clip_tau: float = field(default=100.0, metadata={"help": "QK-clip threshold on the max attention logit."})
    qk_clip_alpha: float = field(
        default=0.5, metadata={"help": "Share of the rescale put on queries (keys get 1 - alpha)."}
    )
    qk_clip_interval: int = field(
        default=1, metadata={"help": "Check (and clip) every N optimizer steps; each check costs one q·k pass."}
    )
    qk_clip_on_lora: Literal["delta", "error"] = field(
        default="delta",
        metadata={
            "help": "With LoRA (frozen base q/k): 'delta' scales the adapters' lora_B rows (cannot fix a "
            "base that alone exceeds tau; reported), 'error' refuses to train."
        },
    )

    def validate(self) -> list[str]:
        problems = kernel_problems(self.backend, self.softcap)
        extras = [n for n, on in (("softcap", self.softcap is not None), ("qk_clip", self.qk_clip)) if on]
        if extras and self.implementation != ATTN_IMPLEMENTATION:
            problems.append(
                f"implementation: got {self.implementation!r}, must be 'hf_stable' when {' and '.join(extras)} "
                "is on (or turn those off)"
            )
        if self.monitor_interval < 0:
            problems.append(f"monitor_interval: got {self.monitor_interval!r}, must be >= 0 (0 = off)")
        if self.logit_growth_checks < 2:
            problems.append(f"logit_growth_checks: got {self.logit_growth_checks!r}, must be >= 2")
        if not 0.0 <= self.logit_growth_min_share <= 1.0:
            problems.append(f"logit_growth_min_share: got {self.logit_growth_min_share!r}, must be in [0, 1]")
        if not self.logit_growth_ratio > 1.0:
            problems.append(f"logit_growth_ratio: got {self.logit_growth_ratio!r}, must be > 1")
        if not self.qk_clip_tau > 0:
            problems.append(f"qk_clip_tau: got {self.qk_clip_tau!r}, must be > 0")
        if not 0.0 <= self.qk_clip_alpha <= 1.0:
            problems.append(f"qk_clip_alpha: got {self.qk_clip_alpha!r}, must be within [0, 1]")
        if self.qk_clip_interval < 1:
            problems.append(f"qk_clip_interval: got {self.qk_clip_interval!r}, must be >= 1")
        return problems
