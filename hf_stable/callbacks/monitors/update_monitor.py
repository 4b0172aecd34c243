"""`UpdateMonitor`: relative update ‖Δθ‖/‖θ‖ per group, and an alert when it is ~0 while gradients are not.

A stalled update with live gradients means the optimizer step does nothing: bf16 weights that cannot represent a
tiny update, a zero LR, parameters missing from the optimizer, a scheduler stuck at 0. Every `every_n_steps`
steps the trainable parameters are copied on device just before `optimizer.step()` (one foreach copy; LoRA
adapters are small, a full fine-tune pays one parameter copy per check) and compared right after it. The
group norms come from `index_add_` over per-tensor norms and reach the host in one transfer per check.

A guard may skip a step by setting `p.grad = None`; groups whose gradients are all None after the optimizer
step are not judged (an intentional skip is not a stall).
"""

from __future__ import annotations

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.compat import foreach_copy, foreach_norm, foreach_sub
from hf_stable.config.stability import UpdateMonitorConfig
from hf_stable.core.engine import StepEngine
from hf_stable.core.grad_stats import GradStats
from hf_stable.core.monitor_utils import AlertGate
from hf_stable.distributed import all_reduce_tensor
from hf_stable.optim.roles import group_parameters


class UpdateMonitor(StabilityCallback):
    """Logs `update/ratio/<group>` and `update/ratio_global`; event `update_stall` per group.

    Args:
        config: a `UpdateMonitorConfig` (default `UpdateMonitorConfig()`; every field is documented there and in
            docs/CONFIG.md).
        **overrides: `UpdateMonitorConfig` fields to change, e.g. `UpdateMonitor(every_n_steps=50)`.

    Example:
        >>> UpdateMonitor(every_n_steps=50)
    """

    def __init__(self, config: UpdateMonitorConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(UpdateMonitorConfig, config, overrides)
        self._gate = AlertGate(cfg.cooldown_steps)
        self._streak: dict[str, int] = {}
        self._snapshot: list[torch.Tensor] | None = None
        self._grad_norms: torch.Tensor | None = None
        self._groups: dict | None = None
        self._off = False
        self.last_ratios: dict[str, float] = {}

    def state_dict(self) -> dict:
        return {"streak": dict(self._streak), "gate": self._gate.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._streak = {k: int(v) for k, v in state.get("streak", {}).items()}
        self._gate.load_state_dict(state.get("gate", {}))

    # --- decisions (pure) -------------------------------------------------------------------------
    def observe(self, step: int, ratios: dict[str, float], grad_norms: dict[str, float]) -> list[dict]:
        """Judge one check: `ratios[group]` = ‖Δθ‖/‖θ‖, `grad_norms[group]` = the step's gradient norm."""
        events = []
        for group, ratio in ratios.items():
            gnorm = grad_norms.get(group, 0.0)
            if ratio < self.stall_ratio and gnorm > self.min_grad_norm:
                self._streak[group] = self._streak.get(group, 0) + 1
            else:
                self._streak[group] = 0
                continue
            if self._streak[group] >= self.patience:
                suppressed = self._gate.allow(step, "update_stall", group)
                if suppressed is None:
                    continue
                msg = (
                    f"{group}: relative update {ratio:.3g} < {self.stall_ratio:g} for {self._streak[group]} checks "
                    f"while its grad norm is {gnorm:.3g} (bf16 weights too coarse? LR 0? not in the optimizer?)"
                )
                if suppressed:
                    msg += f" ({suppressed} similar alerts suppressed)"
                events.append(
                    self.event(
                        step,
                        "update_stall",
                        msg,
                        group=group,
                        value=ratio,
                        threshold=self.stall_ratio,
                        severity="warning",
                        grad_norm=gnorm,
                    )
                )
        return events

    # --- Trainer hooks ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        self._off = False
        self._groups = None

    def _params(self, model) -> tuple[list[str], list[int], list[torch.nn.Parameter]]:
        if self._groups is None:
            groups = group_parameters(model, trainable_only=True)
            names = list(groups)
            self._groups = {
                "names": names,
                "ids": [i for i, g in enumerate(names) for _ in groups[g]],
                "params": [p for g in names for _, p in groups[g]],
            }
        return self._groups["names"], self._groups["ids"], self._groups["params"]

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._snapshot = None
        if not self.enabled or self._off or model is None or (state.global_step + 1) % self.every_n_steps:
            return
        _, _, params = self._params(model)
        if not params:
            return
        if self.engine_unhosted(state, model):
            return
        engine = StepEngine.of(model)
        with torch.no_grad():
            self._snapshot = foreach_copy([engine.local_no_grad(p) for p in params])
        stats = GradStats.shared(model)
        if engine.sharded:  # the local norms are parts: the step's report has the sums over ranks
            read = lambda: self._read_sharded(stats, model, state)
            if not stats.readers.defer(state.global_step, read):  # else: at the skip guard's gather
                read()
        else:
            dev = stats.device_stats(model, step=state.global_step)
            self._grad_norms = None if dev is None else (dev.groups, dev.group_norms)

    def _read_sharded(self, stats: GradStats, model, state) -> None:
        report = stats.compute(model, step=state.global_step)
        norms = [report.group_norms.get(g, float("nan")) for g in stats.group_names]
        self._grad_norms = (stats.group_names, torch.tensor(norms)) if report.available else None

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            GradStats.shared(model).readers.flush(state.global_step)  # a deferred read no gather ran (rank-agreed)
        if self._snapshot is None or model is None:
            return
        names, ids, params = self._params(model)
        snapshot, self._snapshot = self._snapshot, None
        engine = StepEngine.of(model)
        if engine.owns_step:  # the engine cleared its gradients in its step: every group, if it applied it
            judged = sorted(set(ids)) if engine.last_applied else []
        else:
            judged = sorted({ids[i] for i, g in enumerate(engine.local_grads(params)) if g is not None})
        if not judged:
            return
        with torch.no_grad():
            current = [engine.local_no_grad(p) for p in params]
            delta = foreach_sub(current, snapshot)
            d = torch.stack(foreach_norm(delta, 2.0)).square()
            w = torch.stack(foreach_norm(current, 2.0)).square()
            device = d.device
            index = torch.tensor(ids, dtype=torch.long, device=device)
            n = len(names)
            upd = torch.zeros(n, device=device).index_add_(0, index, d)
            norm = torch.zeros(n, device=device).index_add_(0, index, w)
            if engine.sharded:  # each rank's parts: sum the squares over ranks (every rank checks at this step)
                upd, norm = all_reduce_tensor(torch.stack([upd, norm]), "sum").unbind(0)
            ratio = upd.sqrt() / norm.sqrt().clamp_min(1e-12)
            glob = (upd.sum().sqrt() / norm.sum().sqrt().clamp_min(1e-12)).reshape(1)
            parts = [ratio, glob]
            if self._grad_norms is not None and self._grad_norms[0] == names:
                parts.append(self._grad_norms[1].to(device))
            host = torch.cat(parts).tolist()  # one transfer per check
        step = state.global_step + 1
        ratios = {names[g]: host[g] for g in judged}
        grad_norms = {names[g]: host[n + 1 + g] for g in judged} if len(host) > n + 1 else {}
        self.last_ratios = ratios
        metrics = {f"update/ratio/{g}": r for g, r in ratios.items()}
        metrics["update/ratio_global"] = host[n]
        self.record(metrics)
        if grad_norms:
            self.observe(step, ratios, grad_norms)
