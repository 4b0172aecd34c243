"""`FusedAdamW`: torch's AdamW with `fused=True`, stepping many parameter groups at the cost of few.

torch's `AdamW.step` runs its whole Python path once per group: the group's bookkeeping, the functional dispatch,
grouping the tensors by device and dtype, one step-counter add and one fused kernel. The factory's layouts have
many groups (layer-wise LR x LoRA+ A/B x no-decay: 8 on the embedded default, 2 per decoder layer on a 7B), so that
per-group path, not the arithmetic, made the optimizer step 1.2x the Trainer's two-group fused AdamW. Here one pass
gathers every group's tensors, one `_foreach_add_` advances every step counter, and each group is one call of the
same kernel (`torch._fused_adamw_`) with the same arguments torch passes: the result is bit for bit torch's (tests/
test_optim_kernel.py), the state is torch's (`step`, `exp_avg`, `exp_avg_sq`; a checkpoint loads into either class).

Whatever the short path does not cover runs torch's own `step` unchanged: a closure, a GradScaler's `grad_scale` /
`found_inf`, the first step (state not created yet), amsgrad / maximize / capturable / differentiable, a tensor LR
or betas,
sharded (DTensor) or sparse gradients, a group mixing devices or dtypes.
"""

from __future__ import annotations

import torch


def _unhooked(fn):
    """`fn` without the optimizer-hook wrappers torch adds to a class's `step` (`Optimizer._patch_step_function`),
    so falling back to it from our own (hooked) `step` does not run the step hooks twice."""
    while getattr(fn, "hooked", False):
        fn = fn.__wrapped__
    return fn


_TORCH_STEP = _unhooked(torch.optim.Adam.__dict__["step"])
_PLAIN_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


class FusedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(..., fused=True)` with one step-counter add and one kernel call per group.

    Example:
        >>> opt = FusedAdamW([{"params": a, "lr": 1e-4}, {"params": b, "lr": 1.6e-3}], lr=1e-4, fused=True)
    """

    def __init__(self, params, **kwargs):
        kwargs["fused"] = True
        super().__init__(params, **kwargs)

    def _short_path(self) -> list | None:
        """Per group `(group, params, grads, exp_avgs, exp_avg_sqs, steps)` when every group can take the short
        path, else None (torch's own step runs)."""
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            return None
        state = self.state
        calls = []
        for group in self.param_groups:
            tensors = (group["lr"], *group["betas"])
            if any(group[k] for k in _PLAIN_FLAGS) or not group["fused"] or any(torch.is_tensor(x) for x in tensors):
                return None
            params, grads, avgs, sqs, steps = [], [], [], [], []
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                s = state.get(p)
                if not s or type(g) is not torch.Tensor or g.is_sparse:
                    return None  # first step (torch creates the state), DTensor / sparse gradients
                params.append(p)
                grads.append(g)
                avgs.append(s["exp_avg"])
                sqs.append(s["exp_avg_sq"])
                steps.append(s["step"])
            if not params:
                continue
            first = params[0]
            if any(p.device != first.device or p.dtype != first.dtype for p in params):
                return None
            calls.append((group, params, grads, avgs, sqs, steps))
        return calls

    def step(self, closure=None):
        """One AdamW step (see the module docstring); returns the closure's loss as torch's does."""
        calls = None if closure is not None else self._short_path()
        if calls is None:
            return _TORCH_STEP(self, closure)
        if not calls:
            return None
        with torch.no_grad():
            torch._foreach_add_([s for call in calls for s in call[5]], 1)
            for group, params, grads, avgs, sqs, steps in calls:
                beta1, beta2 = group["betas"]
                torch._fused_adamw_(
                    params,
                    grads,
                    avgs,
                    sqs,
                    [],
                    steps,
                    amsgrad=False,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                    grad_scale=None,
                    found_inf=None,
                )
        return None


__all__ = ["FusedAdamW"]
