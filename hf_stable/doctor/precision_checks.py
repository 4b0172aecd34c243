"""The doctor's precision findings: the dtype a run asks for against what the machine computes natively (bf16 on a
GPU older than compute capability 8.0, fp16 or bf16 on a CPU)."""

from __future__ import annotations

from hf_stable.doctor.findings import Finding
from hf_stable.doctor.settings import TrainingSettings
from hf_stable.precision import cpu_has_fast_bf16


def _f(severity: str, name: str, what: str, evidence: str = "", fix: str = "") -> Finding:
    return Finding(severity, what, evidence, fix, check=f"environment.{name}")


def _cpu_capability() -> str:
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def precision_findings(gpus: list[dict], settings: TrainingSettings, cfg) -> list[Finding]:
    out = []
    wants_bf16 = settings.bf16 or cfg.model.dtype == "bfloat16"
    wants_fp16 = settings.fp16 or cfg.model.dtype == "float16"
    if not gpus:
        if wants_fp16:
            out.append(
                _f(
                    "warning",
                    "precision",
                    "fp16 requested on a CPU-only machine",
                    f"training.fp16={settings.fp16}, model.dtype={cfg.model.dtype}",
                    "fp16 brings no speed-up on CPU and risks overflow; use fp32 on CPU (training.fp16: false, "
                    "model.dtype: float32)",
                )
            )
        q = cfg.model.quantization
        if (wants_bf16 or (q.enabled and q.compute_dtype == "bfloat16")) and not cpu_has_fast_bf16():
            out.append(
                _f(
                    "warning",
                    "precision",
                    "bf16 requested on a CPU without native bf16 matmul: a training step here runs on torch's "
                    "reference bf16 kernel, two orders of magnitude slower than fp32",
                    f"training.bf16={settings.bf16}, model.dtype={cfg.model.dtype}, "
                    f"model.quantization.compute_dtype={q.compute_dtype if q.enabled else None}, CPU capability "
                    f"{_cpu_capability()} (no AVX512/AMX bf16)",
                    "train on a GPU; on this CPU use fp32 (training.bf16: false, model.dtype: float32, "
                    "model.quantization.compute_dtype: float32)",
                )
            )
        return out
    no_bf16 = [g["name"] for g in gpus if not g["bf16"]]
    if wants_bf16 and no_bf16:
        out.append(
            _f(
                "error",
                "precision",
                "bf16 requested but a GPU has no native bf16",
                f"{', '.join(sorted(set(no_bf16)))} (compute capability < 8.0)",
                "use fp16 with loss scaling (training.fp16: true, training.bf16: false) or fp32 on this GPU",
            )
        )
    elif not wants_bf16 and not wants_fp16 and not no_bf16:
        out.append(
            _f(
                "info",
                "precision",
                "training in fp32 on GPUs that support bf16",
                ", ".join(sorted({g["name"] for g in gpus})),
                "training.bf16: true is usually faster and numerically safe",
            )
        )
    return out
