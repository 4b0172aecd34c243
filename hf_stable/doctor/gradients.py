"""Gradient verdicts of the dry run: parameters that never train, NaN/Inf gradients, per-group norm statistics.

"A parameter that was frozen by mistake" shows up two ways: an adapter factor with `requires_grad=False` (found
without running anything), and a trainable tensor whose gradient is never a finite non-zero number over the
dry-run steps (cut from the graph, a hook that zeroes it, or LoRA's A behind a B that cannot leave zero).
"""

from __future__ import annotations

import math

import torch

from hf_stable.config.doctor import DoctorConfig
from hf_stable.core.grad_stats import GradStats
from hf_stable.doctor.findings import Finding

_ADAPTER_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def _f(severity: str, name: str, what: str, evidence: str = "", fix: str = "") -> Finding:
    return Finding(severity, what, evidence, fix, check=f"dry_run.{name}")


def names_list(names: list[str], limit: int = 6) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_trainable(model, lora_enabled: bool) -> list[Finding]:
    """Adapter parameters that do not train are a mistake: a frozen LoRA factor never learns (and a frozen,
    zero-initialised B also stops its A from ever getting a gradient)."""
    params = list(model.named_parameters())
    trainable = [n for n, p in params if p.requires_grad]
    if not trainable:
        return [
            _f(
                "error",
                "trainable",
                "the model has no trainable parameter",
                f"{len(params)} parameters, all frozen",
                "attach a LoRA adapter (lora.enabled: true) or unfreeze the weights to train",
            )
        ]
    frozen = [n for n, p in params if not p.requires_grad and any(m in n.split(".") for m in _ADAPTER_MARKERS)]
    if lora_enabled and frozen:
        return [
            _f(
                "error",
                "frozen_adapter",
                f"{len(frozen)} adapter parameter(s) frozen by mistake",
                names_list(frozen),
                "leave peft's adapter parameters trainable (do not freeze them after get_peft_model)",
            )
        ]
    return []


class GradientReader:
    """Per-group gradient norms of the current `.grad`s via `GradStats` (one host transfer per read), plus which
    parameters ever had a finite non-zero gradient and which a non-finite one.

    Args:
        model: the model whose trainable parameters are read (grouped by `group_parameters`, as the monitors do).
        names: the trainable parameter names, in the order `verdicts()` reports them.
        device: where the per-parameter verdict flags live.
    """

    def __init__(self, model, names: list[str], device):
        self.stats = GradStats(model)  # a private instance: the doctor never touches a Trainer's per-step cache
        self.position = {n: i for i, n in enumerate(names)}
        self.ever_ok = torch.zeros(len(names), dtype=torch.bool, device=device)
        self.ever_bad = torch.zeros(len(names), dtype=torch.bool, device=device)

    def read(self, loss: torch.Tensor, track: bool = True, scale: float = 1.0) -> dict:
        dev = self.stats.device_stats()  # no step label: computed fresh on every read
        if dev is None:  # no parameter has a gradient
            return {"loss": float(loss), "norms": [0.0] * len(self.stats.group_names), "nonfinite": 0}
        norms = dev.param_norms / scale
        finite = torch.isfinite(norms)
        if track:
            idx = torch.tensor([self.position[n] for n in dev.names], device=self.ever_ok.device)
            self.ever_ok[idx] = self.ever_ok[idx] | (finite & (norms > 0)).to(self.ever_ok.device)
            self.ever_bad[idx] = self.ever_bad[idx] | (~finite).to(self.ever_ok.device)
        n_bad = (~finite).sum().float()
        host = torch.cat([dev.group_norms / scale, loss.view(1).float().to(norms.device), n_bad.view(1)]).tolist()
        return {"loss": host[-2], "norms": host[:-2], "nonfinite": int(host[-1])}

    def verdicts(self) -> tuple[list[bool], list[bool]]:
        return self.ever_ok.tolist(), self.ever_bad.tolist()


def gradient_findings(names, ever_ok, ever_bad, fp16_scaler: bool, rows: list[dict]) -> list[Finding]:
    """Verdicts over the optimizer steps: NaN/Inf gradients (and from which step), never-trained parameters."""
    out, steps = [], len(rows)
    bad = [n for n, x in zip(names, ever_bad, strict=False) if x]
    dead = [n for n, ok, b in zip(names, ever_ok, ever_bad, strict=False) if not ok and not b]
    if bad and not fp16_scaler:
        first = next(r for r in rows if r["nonfinite"])
        when = f"first at step {first['step']}" + (
            ", where the loss was already non-finite: the weights had diverged"
            if not math.isfinite(first["loss"])
            else ""
        )
        out.append(
            _f(
                "error",
                "gradients",
                f"{len(bad)} parameter(s) got NaN/Inf gradients ({when})",
                names_list(bad),
                "lower the LR, check fp16 overflow, or run with stability.monitors.nonfinite.detect_anomaly",
            )
        )
    elif bad:
        out.append(
            _f(
                "info",
                "gradients",
                f"fp16 loss scaler skipped steps with NaN/Inf gradients ({len(bad)} tensors)",
                names_list(bad),
                "normal while the loss scale calibrates; persistent skips mean overflow",
            )
        )
    if dead:
        out.append(
            _f(
                "error",
                "dead_parameters",
                f"{len(dead)} trainable parameter(s) never got a non-zero gradient in {steps} steps",
                names_list(dead, 8),
                "these were frozen by mistake or are cut off from the loss: check requires_grad, detach() "
                "calls, a frozen LoRA B (its A then never trains) or modules the forward never calls",
            )
        )
    if not bad and not dead:
        out.append(
            _f(
                "ok",
                "gradients",
                f"all {len(names)} trainable tensors got finite non-zero gradients",
                f"{steps} steps",
            )
        )
    return out


def group_statistics(rows, gnames, doctor: DoctorConfig) -> tuple[dict, list[Finding]]:
    if not rows:
        return {}, []  # the loss diverged in phase 1: there are no post-step weights worth measuring
    stats, low, noisy = {}, [], []
    for gi, g in enumerate(gnames):
        xs = [r["norms"][gi] for r in rows if math.isfinite(r["norms"][gi])]
        if not xs:
            continue
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        stats[g] = {"mean": mean, "std": std, "min": min(xs), "max": max(xs)}
        if mean < doctor.grad_mean_min:
            low.append(f"{g} {mean:.2e}")
        elif std > doctor.grad_cv_max * mean:
            noisy.append(f"{g} {mean:.2e}±{std:.1e}")
    window = f"{len(rows)} batches at the post-step weights"
    out = []
    if low:
        out.append(
            _f(
                "warning",
                "grad_norms",
                f"{len(low)} group(s) with mean grad norm < {doctor.grad_mean_min:g}",
                f"{window}: {names_list(low)}",
                "vanishing gradients: check the LR ladder (optim.llrd_decay), frozen inputs, or raise the LoRA alpha",
            )
        )
    if noisy:
        # info, not warning: with ~10 batches the std estimate itself is uncertain by ~25%, and noisy gradients
        # are a property of the batch size more than a defect.
        out.append(
            _f(
                "info",
                "grad_norms",
                f"{len(noisy)} group(s) with grad-norm std > {doctor.grad_cv_max:g} x mean (noisy gradients)",
                f"{window}: {names_list(noisy)}",
                "a larger effective batch or a lower LR reduces the noise",
            )
        )
    if not out:
        worst = max((v["std"] / v["mean"] for v in stats.values() if v["mean"] > 0), default=0.0)
        out.append(
            _f(
                "ok",
                "grad_norms",
                f"per-group grad norms healthy in {len(stats)} groups",
                f"{window}; largest std/mean {worst:.2f} (limit {doctor.grad_cv_max:g})",
            )
        )
    return stats, out
