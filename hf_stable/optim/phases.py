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

Resumable: `state_dict()` holds the phase index and the inner optimizer's state, so the Trainer's own checkpoint
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
        init_optimizer_hooks(self)
        self._sync()

    def _sync(self) -> None:
        self.param_groups = self.current.param_groups
        self.state = self.current.state
        self.defaults = self.current.defaults

    def __repr__(self) -> str:
        return f"PhasedOptimizer(phase {self.phase}: {self.names[self.phase]}, {type(self.current).__name__})"

    def step(self, closure: Callable | None = None):
        return self.current.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.current.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.current.add_param_group(param_group)

    def state_dict(self) -> dict:
        return {"phase": self.phase, "inner": self.current.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "inner" not in state_dict:  # a plain optimizer's state (phase 0)
            self.current.load_state_dict(state_dict)
        else:
            if int(state_dict["phase"]) != self.phase:
                self.switch(int(state_dict["phase"]), policy="reset")
            self.current.load_state_dict(state_dict["inner"])
        self._sync()  # torch's load_state_dict builds a new param_groups list

    def switch(self, phase: int, policy: str | None = None) -> None:
        """Replace the inner optimizer by phase `phase`'s, keeping groups (and, per policy, the momentum)."""
        policy = policy or self.state_policy
        old = self.current
        groups = [
            {k: v for k, v in g.items() if k not in old.defaults or k in ("lr", "weight_decay")}
            for g in old.param_groups
        ]
        new = make_optimizer(self.names[phase], groups, self.optim_cfg, self.hyperparameters)
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
        self.current, self.phase = new, phase
        self._sync()


_NAME_OF = {"AdamW": "adamw", "FusedAdamW": "adamw", "SGD": "sgd", "Lion": "lion"}


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
