"""Reading fp16 loss scaling from callbacks: is the gradient about to overflow, was the step skipped, what scale.

Under `fp16: true` accelerate's `GradScaler` skips the optimizer step and halves the scale whenever a gradient is
inf/NaN, routinely at the start of a run, so guards and alarms must tell that apart from a real failure. The
helpers take what callbacks receive as `optimizer` (accelerate's wrapper, or DeepSpeed's) and return None without
loss scaling (fp32, bf16):

* `unscale_gradients` (in `on_pre_optimizer_step`): unscales the gradients if accelerate has not yet (it has with
  `max_grad_norm > 0`; the scaler unscales at most once per step) and says whether the scaler will skip the step.
* `step_was_skipped` (in `on_optimizer_step` / `on_step_end`).

A guard skips by setting `p.grad = None` after `unscale_gradients`: `scaler.step` then leaves those parameters
untouched and `scaler.update()` keeps the scale. On CPU, `fp16: true` trains in plain fp32 (accelerate makes no
scaler or fp16 autocast there, transformers 5.24 / accelerate 1.15); `bf16: true` does autocast on CPU
(`training_autocast`).
"""

from __future__ import annotations


def grad_scaler(optimizer):
    """The `torch.amp.GradScaler` behind a (wrapped) optimizer, or None when there is no loss scaling."""
    return getattr(optimizer, "scaler", None)


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def _is_deepspeed_fp16(optimizer) -> bool:
    inner = _inner(optimizer)
    return hasattr(inner, "overflow") and hasattr(inner, "cur_scale")


def loss_scale(optimizer) -> float | None:
    """The current loss scale (None without loss scaling)."""
    scaler = grad_scaler(optimizer)
    if scaler is not None:
        return float(scaler.get_scale())
    if _is_deepspeed_fp16(optimizer):
        return float(_inner(optimizer).cur_scale)
    return None


def unscale_gradients(optimizer) -> bool | None:
    """Unscale fp16 gradients in place now (if not done yet this step); True when the scaler found inf/NaN.

    Call it in `on_pre_optimizer_step` before reading gradients. Returns None without a GradScaler (fp32,
    bf16, and DeepSpeed, whose fp16 optimizer keeps its own flat buffers: read `step_was_skipped` after the step).
    Every rank gets the same answer: gradients are already all-reduced when this hook runs.
    """
    from hf_stable.compat import scaler_unscale_once

    scaler = grad_scaler(optimizer)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler_unscale_once(scaler, _inner(optimizer))


def step_was_skipped(optimizer) -> bool | None:
    """After the optimizer step: True when fp16 loss scaling skipped it (overflow), None without loss scaling."""
    if grad_scaler(optimizer) is None and not _is_deepspeed_fp16(optimizer):
        return None
    if hasattr(optimizer, "step_was_skipped"):
        return bool(optimizer.step_was_skipped)
    return bool(_inner(optimizer).overflow)


def training_autocast(args, device):
    """The autocast the Trainer's forward runs under (accelerate's mixed precision), so a re-run of a training
    batch (non-finite locator, rollback check) sees the same numerics: bf16 on CUDA or CPU, fp16 on CUDA only (on
    CPU `fp16: true` trains in fp32, see above). A null context otherwise."""
    import contextlib

    import torch

    if getattr(args, "bf16", False) and device.type in ("cuda", "cpu"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if getattr(args, "fp16", False) and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    return contextlib.nullcontext()


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (oneDNN on AVX512/AMX, or Arm's bf16 extension).

    Without that (an AVX2-only x86 CPU), torch's bf16 `a @ w` falls back to a reference kernel: measured on a 2-core
    AVX2 machine (torch 2.13), a [64, 128256] x [128256, 1024] product took 152 s in bf16 and 0.53 s in fp32, so a
    backward through a large LM head or MLP takes minutes per step. Where torch cannot say, assume it is fast.
    """
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True
