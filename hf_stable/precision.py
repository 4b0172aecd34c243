"""Reading fp16 loss scaling from callbacks: is the gradient about to overflow, was the step skipped, what scale.

Under `fp16: true` the Trainer (through accelerate) multiplies the loss by a scale before backward, unscales
the gradients before clipping and lets `torch.amp.GradScaler` *skip* the optimizer step and halve the scale
when any gradient is inf/NaN. That is routine — it happens a few times at the start of every fp16 run — so a
skip-step guard or a non-finite alarm must not treat it as a failure. These helpers let callbacks tell the
two apart. They accept what callbacks receive as `optimizer` (accelerate's `AcceleratedOptimizer`, or its
DeepSpeed wrapper) and return None when there is no loss scaling (fp32, bf16).

Where the numbers come from:

* `on_pre_optimizer_step`: with `max_grad_norm > 0` accelerate has already unscaled the gradients (clipping
  needs true values); with `max_grad_norm = 0` they are still multiplied by the scale. `unscale_gradients`
  unscales them now if needed (GradScaler does it at most once per step, so the later `scaler.step` does not
  unscale again) and says whether an inf/NaN was found — i.e. whether the scaler will skip this step.
* `on_optimizer_step` / `on_step_end`: `step_was_skipped` says whether the scaler skipped the step.

How a skip-step guard composes with the scaler: the guard skips by setting `p.grad = None` in
`on_pre_optimizer_step` (after calling `unscale_gradients`). `scaler.step` then runs `optimizer.step()`,
which leaves parameters without a gradient untouched (no momentum, no weight decay), and `scaler.update()`
keeps the scale — the guard's skip does not count as an overflow. When the scaler itself found an overflow it
skips the step anyway; the guard should log it as `fp16_overflow`, not as a bad step.

Platform fact (checked with transformers 5.24 / accelerate 1.15): on CPU, `fp16: true` trains in plain fp32 —
accelerate creates no GradScaler and no fp16 autocast for the CPU device, silently. Loss scaling therefore
only happens on GPUs; `bf16: true` does use CPU autocast.

Example:
    >>> class Guard(TrainerCallback):
    ...     def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
    ...         if unscale_gradients(optimizer):
    ...             return  # fp16 overflow: the scaler skips this step and lowers the scale by itself
    ...     def on_step_end(self, args, state, control, optimizer=None, **kw):
    ...         if step_was_skipped(optimizer): ...
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
