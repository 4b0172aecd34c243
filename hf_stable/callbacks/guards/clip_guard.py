"""`ClipGuard`: gradient clipping owned by hf_stable — global, per group, or adaptive per group (ZClip-style).

It replaces the Trainer's single global clip (the recipe sets `TrainingArguments.max_grad_norm=0`; with both on
the gradients are clipped twice, so the guard warns - and says whether the monitors' statistics are pre-clip, as
under `StableTrainer`, or post-clip, as under the stock Trainer). It reuses the
norms `GradStats` already computed for the monitors — one gradient computation per step — and decides the
per-group coefficients on the host from that single transfer; applying them is one `_foreach_mul_` per distinct
factor on device, so clipping adds no host sync.

Modes:

* `global`: scale every gradient by `min(1, max_norm / ||g||)` (what `clip_grad_norm_` does).
* `per_group`: each report group (embeddings, each decoder layer, each layer's LoRA A and B, final norm,
  lm_head) is clipped to the max norm of its site: embeddings 0.3, decoder layers 0.8, lm_head 0.5 by default.
* `adaptive`: per group, an EMA (alpha 0.97) of the norm's mean and variance; a group whose z-score exceeds
  `z_threshold` (2.5) is scaled to `mean + z * std` and the EMA learns the clipped value, so one spike cannot
  drag the threshold up. The first `warmup_steps` steps only collect statistics. `max_norm` stays an outer
  global cap (and is the only rule during warm-up).
* `agc_lambda` (any mode): unit-wise adaptive gradient clipping, `||g_row|| <= lambda * max(||w_row||, eps)`.
  Zero-initialised LoRA B has `||w|| = 0`, so its rows are held to `lambda * eps` until B grows; keep AGC off
  for LoRA unless `agc_eps` is set accordingly.

A step the `SkipGuard` skips is not clipped and not learned from.
"""

from __future__ import annotations

import math

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.compat import foreach_mul_
from hf_stable.config.guards import DEFAULT_GROUP_MAX_NORM, ClippingConfig
from hf_stable.core.engine import StepEngine
from hf_stable.core.grad_stats import GradReport, GradStats

MODES = ("global", "per_group", "adaptive")


def site_of(group: str) -> str:
    """'layer_3.lora_B' -> 'layer', 'embeddings.lora_A' -> 'embeddings', 'lm_head' -> 'lm_head'."""
    head = group.split(".")[0]
    return "layer" if head.startswith("layer_") else head


class ClipGuard(StabilityCallback):
    """Clips gradients globally, per group or adaptively per group; metrics `clip/*`.

    Args:
        config: a `ClippingConfig` (default `ClippingConfig()`; every field is documented there and in
            docs/CONFIG.md). Sites missing from `group_max_norm` keep their default.
        skip_guard: the `SkipGuard` (listed before this guard); skipped steps are left alone.
        **overrides: `ClippingConfig` fields to change, e.g. `ClipGuard(mode="global", max_norm=1.0)`.

    Raises:
        ValueError: an unknown mode.

    Example:
        >>> ClipGuard(mode="per_group", group_max_norm={"embeddings": 0.3, "layer": 0.8, "lm_head": 0.5})
    """

    def __init__(self, config: ClippingConfig | None = None, *, skip_guard=None, **overrides):
        super().__init__()
        cfg = self._use_config(ClippingConfig, config, overrides)
        if cfg.mode not in MODES:
            raise ValueError(f"ClipGuard mode: got {cfg.mode!r}, allowed: {', '.join(MODES)}")
        self.group_max_norm = {**DEFAULT_GROUP_MAX_NORM, **(cfg.group_max_norm or {})}
        self.skip_guard = skip_guard
        self._stats: dict[str, list[float]] = {}  # group -> [mean, var, n]
        self._clipped_steps = 0
        self._off = False
        self._agc_said = False
        self.last_coefficients: dict[str, float] = {}
        self._members_of: tuple | None = None  # (the statistics' group id list, `_members` of it, their devices)

    # --- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"stats": {g: list(v) for g, v in self._stats.items()}, "clipped_steps": self._clipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self._stats = {g: [float(x) for x in v] for g, v in state.get("stats", {}).items()}
        self._clipped_steps = int(state.get("clipped_steps", 0))

    def stats_state(self) -> dict:
        """The adaptive statistics only (what a rollback restores with the weights)."""
        return {"stats": {g: list(v) for g, v in self._stats.items()}}

    def after_rollback(self, state: dict) -> None:
        """Called by `RollbackGuard` after restoring weights: the statistics go back to the snapshot's."""
        self._stats = {g: [float(x) for x in v] for g, v in state.get("stats", {}).items()}

    # --- decisions (pure, host numbers) -------------------------------------------------------------------
    def coefficients(self, group_norms: dict[str, float], global_norm: float) -> dict[str, float]:
        """Scale factor per group (1.0 = untouched) for this step; the adaptive statistics learn from it."""
        finite = {g: n for g, n in group_norms.items() if math.isfinite(n)}
        coefs = dict.fromkeys(group_norms, 1.0)
        if self.mode == "global":
            if math.isfinite(global_norm) and self.max_norm is not None:
                c = min(1.0, self.max_norm / (global_norm + 1e-6))
                coefs = dict.fromkeys(group_norms, c)
            return coefs
        if self.mode == "per_group":
            for g, n in finite.items():
                coefs[g] = min(1.0, self.group_max_norm.get(site_of(g), self.group_max_norm["other"]) / (n + 1e-6))
            return coefs
        a = self.ema_alpha
        for g, n in finite.items():
            mean, var, count = self._stats.get(g, [0.0, 0.0, 0.0])
            clipped = n
            if count >= self.warmup_steps:
                limit = mean + self.z_threshold * math.sqrt(max(var, 0.0))
                if n > limit > 0:
                    coefs[g] = limit / n
                    clipped = limit
                delta = clipped - mean
                mean = a * mean + (1 - a) * clipped
                var = a * var + (1 - a) * delta * delta
            else:  # warm-up: exact running mean / variance (Welford) as the EMA's starting point
                count_new = count + 1
                delta = n - mean
                mean += delta / count_new
                var += (delta * (n - mean) - var) / count_new
            self._stats[g] = [mean, var, min(count + 1, self.warmup_steps)]
        if self.max_norm is not None:
            after = math.sqrt(sum((coefs[g] * n) ** 2 for g, n in finite.items()))
            if after > self.max_norm:
                cap = self.max_norm / (after + 1e-6)
                coefs = {g: c * cap for g, c in coefs.items()}
        return coefs

    def _members(self, dev) -> dict[int, list[tuple[torch.device, list[int]]]]:
        """Group id -> [(device, indices into `dev.params`)], kept while the statistics keep their group list (the
        usual case: every trainable tensor has a gradient), so a step does not walk the parameters' devices."""
        cached = self._members_of
        if cached is not None and cached[0] is dev.group_ids:
            return cached[1]
        members: dict[int, dict[torch.device, list[int]]] = {}
        for i, (p, gi) in enumerate(zip(dev.params, dev.group_ids, strict=False)):
            members.setdefault(gi, {}).setdefault(p.device, []).append(i)
        out = {gi: list(by_device.items()) for gi, by_device in members.items()}
        self._members_of = (dev.group_ids, out, {torch.device(d) for by_device in members.values() for d in by_device})
        return out

    def _apply(self, dev, coefs: dict[str, float], engine: StepEngine, shared: torch.Tensor | None = None) -> None:
        """Scale each clipped group's gradients by its factor: one foreach call per distinct factor and device (one in
        all when the global cap sets every factor), the factor a 0-d tensor (on CPU torch's foreach multiply by a
        Python number is ~4x slower than by a tensor; same bits). `shared`: the one factor every tensor takes, as a
        0-d tensor already made (used on its own device)."""
        grads = engine.local_grads(dev.params)
        members = self._members(dev)
        if shared is not None and self._members_of[2] == {shared.device}:  # every tensor, one device: one call
            clipped = [g for g in grads if g is not None and g.numel()]
            if clipped:
                foreach_mul_(clipped, shared)
            return
        by_factor: dict[tuple, list[int]] = {}
        for gi, runs in members.items():
            c = coefs.get(dev.groups[gi], 1.0)
            if c < 1.0:
                for device, idx in runs:
                    by_factor.setdefault((c, device), []).extend(idx)
        for (c, device), idx in by_factor.items():
            clipped = [g for g in map(grads.__getitem__, idx) if g is not None and g.numel()]
            if clipped:
                reuse = shared is not None and shared.device == torch.device(device)
                foreach_mul_(clipped, shared if reuse else torch.tensor(c, dtype=torch.float32, device=device))

    def _agc(self, dev, engine: StepEngine) -> None:
        with torch.no_grad():
            for p, g in zip(dev.params, engine.local_grads(dev.params), strict=True):
                p = engine.local(p)
                if g is None or not g.numel():
                    continue
                dims = tuple(range(1, g.dim())) if g.dim() > 1 else None
                w_norm = (
                    p.detach().float().norm(dim=dims, keepdim=True) if dims else p.detach().float().norm()
                ).clamp_min(self.agc_eps)
                g_norm = g.float().norm(dim=dims, keepdim=True) if dims else g.float().norm()
                limit = self.agc_lambda * w_norm
                factor = torch.where(g_norm > limit, limit / g_norm.clamp_min(1e-12), torch.ones_like(g_norm))
                g.mul_(factor.to(g.dtype))

    # --- Trainer hooks ------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        if not self.enabled:
            return
        self._off = False
        if args.max_grad_norm and args.max_grad_norm > 0:
            # StableTrainer reads the statistics before its clip (`GradStats.pre_clip`); the stock Trainer clips first
            pre_clip = model is not None and GradStats.shared(model).pre_clip
            seen = (
                "the monitors' statistics stay pre-clip (StableTrainer), but this guard judges already-clipped gradients"
                if pre_clip
                else "the monitors' statistics and this guard see post-clip gradients"
            )
            self.event(
                state.global_step,
                "guard_notice",
                f"TrainingArguments.max_grad_norm={args.max_grad_norm} clips before this guard: gradients are "
                f"clipped twice and {seen}; set max_grad_norm=0",
                severity="warning",
            )

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.enabled or self._off or model is None or self.engine_unhosted(state, model):
            return
        step = state.global_step + 1
        verdict = self.skip_guard.verdict_for(step) if self.skip_guard is not None else None
        if verdict is not None and verdict.skip:
            return
        stats = GradStats.shared(model)
        report: GradReport = stats.compute(model, step=state.global_step)
        dev = stats.last_device_stats  # what `compute` just checked and read
        if not report.available or dev is None:
            return
        coefs = self.coefficients(report.group_norms, report.global_norm)
        clipped = [g for g, c in coefs.items() if c < 1.0]
        if clipped or self.agc_lambda is not None:
            # our own edit: the step's statistics stay pre-clip (a later max |g| is divided by the group's factor;
            # AGC's per-row factors are not undone)
            scale = shared = None
            if clipped:  # per tensor: its group's factor (one 0-d tensor, also the multiplier, when they are equal)
                by_group = [coefs.get(g, 1.0) for g in dev.groups]
                factors = [by_group[gi] for gi in dev.group_ids]
                home = dev.param_norms.device
                if len(set(factors)) == 1:  # the global cap alone: every tensor scaled by the same factor
                    scale = shared = torch.full((), factors[0], dtype=torch.float32, device=home)
                else:
                    scale = torch.tensor(factors, dtype=torch.float32, device=home)
            engine = stats.engine
            with stats.edited(state.global_step, scale, read=dev):  # `dev`: what `compute` just checked
                self._apply(dev, coefs, engine, shared)
                if self.agc_lambda is not None and engine.whole_rows:
                    self._agc(dev, engine)
                elif self.agc_lambda is not None and not self._agc_said:
                    self._agc_said = True
                    self.event(
                        state.global_step,
                        "guard_notice",
                        f"ClipGuard: AGC (agc_lambda) is not applied under {engine.describe()}: its partitions are "
                        "flat slices, not whole rows of each weight; the per-group clip still runs",
                        severity="warning",
                    )
        self.last_coefficients = coefs
        self._clipped_steps += bool(clipped)
        after = math.sqrt(sum((coefs[g] * n) ** 2 for g, n in report.group_norms.items() if math.isfinite(n)))
        self.record(
            {
                "clip/coef_min": min(coefs.values(), default=1.0),
                "clip/groups_clipped": float(len(clipped)),
                "clip/norm_after": after,
                "clip/steps_clipped": float(self._clipped_steps),
            }
        )
