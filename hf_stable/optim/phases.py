"""Optimizer phases: e.g. AdamW until step 500, SGD+momentum until 2000, then Lion — inside the stock Trainer.

The Trainer, accelerate's wrapper and the LR scheduler all hold a reference to the optimizer object, so it cannot
be replaced mid-run. `PhasedOptimizer` is that object from the start: a thin `torch.optim.Optimizer` whose
`param_groups`, `state`, `step` and `zero_grad` are those of an inner optimizer that `switch()` replaces in
place. The new inner optimizer gets the same groups in the same order — the factory's roles, names, per-group LR
(LLRD, LoRA+), `initial_lr` and weight decay — so the scheduler keeps scaling each group from its own base LR;
optimizer-specific keys (betas, eps, momentum ...) are the new optimizer's own. A phase's `lr_scale` is the
`phase` factor of `LRControl` (Lion wants a smaller LR, SGD a larger one).

State policy at a switch (`state_policy`):

* `reset`: the new optimizer starts fresh.
* `carry_momentum` (default): the first moment survives where the new optimizer has one — AdamW/Lion `exp_avg`
  (an EMA of gradients) seeds Lion's `exp_avg` or, times 1/(1 - momentum), SGD's `momentum_buffer` (a sum), and
  an SGD buffer seeds `exp_avg` the other way round. AdamW always starts fresh: its bias correction assumes
  zero-initialised moments, and a second moment cannot be made up.

Step size at a switch (`match`): the optimizers' update directions differ in size - AdamW's m/sqrt(v) has an RMS
of ~0.2-0.5 late in a fine-tune, Lion's sign() exactly 1, SGD's momentum the gradient's own scale - so a fixed LR
multiplier per optimizer (SGD x10, Lion x0.3) is right for one run and wrong for the next (on the rescue
benchmark's clean LoRA run SGD x10 stepped 2.3x smaller than the AdamW it replaced). A phase with `lr_scale: null`
instead grafts the step size of the phase before onto its own direction (learning-rate grafting: Agarwal et al.,
"Disentangling Adaptive Gradient Methods from Learning Rates", arXiv 2002.11803), once, at the switch: per param
group, the new optimizer's LR is multiplied by RMS(previous update) / RMS(new direction), both estimated from the
optimizer state at the switch (AdamW m_hat/(sqrt(v_hat)+eps), SGD's momentum buffer, Lion's sign(exp_avg) - the new
one from the carried first moment). The schedule still decays the LR on top. The multiplier is fixed for the
phase, applied inside `step()` and kept in `state_dict()`; it is 1 for a fresh AdamW (the reference scale) or when a
side cannot be estimated (SGD without momentum, a group with no state yet).

Resumable: `state_dict()` holds the phase index, the grafting multipliers and the inner optimizer's state, so the Trainer's own checkpoint
(optimizer.pt) restores the right optimizer; the guard's trigger state rides in the callback state
(`callbacks/guards/optimizer_phase_guard.py`). Switches are
decided from `global_step` or from the per-step loss that `GradStats` already sums over ranks, so every rank
switches at the same step. Not supported with `optimizer_cls_and_kwargs` (FSDP) or DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_stable.compat import init_optimizer_hooks
from hf_stable.config.guards import OptimizerPhasesConfig
from hf_stable.optim.factory import optimizer_over_groups
from hf_stable.optim.groups import BaseHyperparameters, resolve_hyperparameters


def unwrap_optimizer(optimizer):
    """The optimizer under accelerate's `AcceleratedOptimizer` (param groups are shared either way)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


def make_optimizer(
    name: str, groups: list[dict], optim_cfg=None, hyperparameters: BaseHyperparameters | None = None
) -> torch.optim.Optimizer:
    """AdamW / SGD / Lion over ready param groups, built by the factory (`optim.factory.optimizer_over_groups`).

    `hyperparameters` carries the run's Adam betas/eps and fp16 flag (from `resolve_hyperparameters(args)`);
    without it the TrainingArguments defaults apply. Per-group lr and weight_decay come from `groups`.
    """
    hp = hyperparameters or _default_hyperparameters(groups)
    return optimizer_over_groups(name, groups, optim_cfg, hp, key="phases[].name")


def _default_hyperparameters(groups: list[dict], first: torch.optim.Optimizer | None = None) -> BaseHyperparameters:
    """The factory's hyperparameters when the caller gave none: those of an AdamW `first`, else the defaults."""
    lr = next((g["lr"] for g in groups if g.get("lr", 0) > 0), None) if groups else None
    extra = {}
    if isinstance(first, torch.optim.AdamW):
        extra = {"betas": tuple(first.defaults["betas"]), "eps": first.defaults["eps"]}
    return resolve_hyperparameters(lr=lr or 1e-3, weight_decay=0.0, **extra)


def _first_moment(opt: torch.optim.Optimizer, p) -> torch.Tensor | None:
    s = opt.state.get(p, {})
    if "exp_avg" in s:
        return s["exp_avg"]
    buf = s.get("momentum_buffer")
    if buf is not None:
        mu = next(g.get("momentum", 0.0) for g in opt.param_groups if any(q is p for q in g["params"]))
        return buf * (1 - mu)
    return None


class PhasedOptimizer(torch.optim.Optimizer):
    """An optimizer whose inner optimizer can be switched in place (see module docstring).

    Args:
        first: the optimizer of phase 0 (e.g. from `build_optimizer`).
        names: optimizer name of every phase ("adamw", "sgd", "lion"); `names[0]` must match `first`.
        optim_cfg: the `optim:` section (SGD momentum, Lion betas, AdamW kernel, fp16 eps guard).
        state_policy: "carry_momentum" or "reset" (module docstring).
        hyperparameters: Adam betas/eps and fp16 of the run (`resolve_hyperparameters(training_args)`); default:
            those of `first` when it is AdamW, else the TrainingArguments defaults.

    Example:
        >>> opt = PhasedOptimizer(build_optimizer(model, cfg.optim, args), ["adamw", "sgd", "lion"], cfg.optim)
        >>> trainer = Trainer(..., optimizers=(opt, None), callbacks=[OptimizerPhaseGuard(lr, phases)])
    """

    def __init__(
        self,
        first: torch.optim.Optimizer,
        names: list[str],
        optim_cfg=None,
        state_policy: str = OptimizerPhasesConfig.state_policy,
        hyperparameters: BaseHyperparameters | None = None,
    ):
        # Optimizer.__init__ is not called on purpose: groups and state belong to the inner optimizer.
        self.names = list(names)
        self.optim_cfg = optim_cfg
        self.hyperparameters = hyperparameters or _default_hyperparameters(first.param_groups, first)
        self.state_policy = state_policy
        self.phase = 0
        self.current = first
        self.graft: list[float] = [1.0] * len(first.param_groups)  # per-group LR multiplier of this phase (match)
        init_optimizer_hooks(self)
        self._sync()

    def _sync(self) -> None:
        self.param_groups = self.current.param_groups
        self.state = self.current.state
        self.defaults = self.current.defaults

    def __repr__(self) -> str:
        return f"PhasedOptimizer(phase {self.phase}: {self.names[self.phase]}, {type(self.current).__name__})"

    def step(self, closure: Callable | None = None):
        if all(g == 1.0 for g in self.graft):
            return self.current.step(closure)
        lrs = [group["lr"] for group in self.param_groups]
        for group, g, lr in zip(self.param_groups, self.graft, lrs, strict=False):
            group["lr"] = lr * g
        try:
            return self.current.step(closure)
        finally:  # the scheduler and LRControl see their own LR again
            for group, lr in zip(self.param_groups, lrs, strict=False):
                group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.current.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.current.add_param_group(param_group)

    def state_dict(self) -> dict:
        return {"phase": self.phase, "graft": list(self.graft), "inner": self.current.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "inner" not in state_dict:  # a plain optimizer's state (phase 0)
            self.current.load_state_dict(state_dict)
        else:
            if int(state_dict["phase"]) != self.phase:
                self.switch(int(state_dict["phase"]), policy="reset")
            self.current.load_state_dict(state_dict["inner"])
            self.graft = [float(g) for g in state_dict.get("graft", [1.0] * len(self.current.param_groups))]
        self._sync()  # torch's load_state_dict builds a new param_groups list

    def switch(self, phase: int, policy: str | None = None, match: float | None = None) -> None:
        """Replace the inner optimizer by phase `phase`'s, keeping groups (and, per policy, the momentum).

        `match`: graft the previous phase's step size onto the new optimizer (module docstring); the number is the
        previous phase's LR factor (its `lr_scale`), which the new phase no longer applies. None: no grafting.
        """
        policy = policy or self.state_policy
        old = self.current
        groups = [
            {k: v for k, v in g.items() if k not in old.defaults or k in ("lr", "weight_decay")}
            for g in old.param_groups
        ]
        new = make_optimizer(self.names[phase], groups, self.optim_cfg, self.hyperparameters)
        graft = [1.0] * len(new.param_groups)
        if match is not None and self.names[phase] != "adamw":
            for i, (g_old, g_new) in enumerate(zip(old.param_groups, new.param_groups, strict=True)):
                before = _update_rms(old, g_old)
                after = _direction_rms(self.names[phase], old, g_new)
                if before and after:
                    graft[i] = match * self.graft[i] * before / after
        if policy == "carry_momentum" and self.names[phase] != "adamw":
            with torch.no_grad():
                for group in new.param_groups:
                    for p in group["params"]:
                        m = _first_moment(old, p)
                        if m is None:
                            continue
                        if self.names[phase] == "lion":
                            new.state[p]["exp_avg"] = m.clone()
                        elif group.get("momentum", 0.0) > 0:
                            new.state[p]["momentum_buffer"] = m / (1 - group["momentum"])
        self.current, self.phase, self.graft = new, phase, graft
        self._sync()


def _rms(tensors: list[torch.Tensor]) -> float | None:
    if not tensors:
        return None
    total = sum(float(t.float().pow(2).sum()) for t in tensors)
    count = sum(t.numel() for t in tensors)
    return (total / count) ** 0.5 if count else None


@torch.no_grad()
def _update_rms(opt: torch.optim.Optimizer, group: dict) -> float | None:
    """RMS of `opt`'s update direction over `group` (times the LR gives its step), from its state; None if unknown."""
    dirs = []
    for p in group["params"]:
        s = opt.state.get(p, {})
        if "exp_avg_sq" in s:  # AdamW: bias-corrected m / (sqrt(v) + eps)
            b1, b2 = group["betas"]
            t = float(s["step"])
            m_hat = s["exp_avg"] / (1 - b1**t)
            dirs.append(m_hat / ((s["exp_avg_sq"] / (1 - b2**t)).sqrt() + group["eps"]))
        elif "exp_avg" in s:  # Lion: sign of the interpolated momentum (the state's exp_avg stands for it)
            dirs.append(torch.sign(s["exp_avg"]))
        elif s.get("momentum_buffer") is not None:  # SGD with momentum: the buffer is the step direction
            dirs.append(s["momentum_buffer"])
    return _rms(dirs)


@torch.no_grad()
def _direction_rms(name: str, old: torch.optim.Optimizer, group: dict) -> float | None:
    """RMS of optimizer `name`'s direction over `group` at the switch, from the previous optimizer's first moment."""
    moments = [m for m in (_first_moment(old, p) for p in group["params"]) if m is not None]
    if not moments:
        return None
    if name == "lion":
        return _rms([torch.sign(m) for m in moments])
    mu = group.get("momentum", 0.0)
    return _rms(moments) / (1 - mu) if mu > 0 else None  # SGD: the buffer settles at the mean gradient / (1 - mu)


_NAME_OF = {"AdamW": "adamw", "SGD": "sgd", "Lion": "lion"}


def wrap_for_phases(optimizer: torch.optim.Optimizer, phases_cfg, optim_cfg=None, args=None) -> PhasedOptimizer:
    """The recipe's optimizer wrapped for `stability.guards.phases` (phase 0 built anew if the factory made another).

    `args` (TrainingArguments) gives every later phase the factory's Adam betas/eps and fp16 eps guard.

    Example:
        >>> optimizer = build_optimizer(model, cfg.optim, args)
        >>> if cfg.stability.guards.phases.enabled:
        ...     optimizer = wrap_for_phases(optimizer, cfg.stability.guards.phases, cfg.optim, args)
    """
    names = [p.name for p in phases_cfg.phases]
    hp = resolve_hyperparameters(args) if args is not None else None
    wrapped = PhasedOptimizer(optimizer, names, optim_cfg, phases_cfg.state_policy, hp)
    if _NAME_OF.get(type(optimizer).__name__) != names[0]:
        wrapped.switch(0, policy="reset")
    return wrapped
