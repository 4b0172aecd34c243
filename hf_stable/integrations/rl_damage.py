"""A GRPO / RLOO step whose own inputs are damaged: non-finite log-probs or an exploding importance ratio.

The policy-gradient loss weights each completion token by the importance ratio ``exp(logp - old_logp)`` between
the policy being trained and the one that sampled (TRL's ``old_per_token_logps``; RLOO's per-sequence
``old_logps``; with vLLM also ``sampling_per_token_logps``). A NaN in those log-probs (a sampler fault) or a ratio
in the thousands (the sampler and the trainer disagree: TRL 4772, 6789) damages the step itself, whatever its
gradient norm looks like. `DamageTap` reads them where TRL computes the loss, on device and without a host sync:

* ``rl_nonfinite_logps``: completion tokens (under the completion mask; sequences for RLOO) whose old or sampling
  log-prob is NaN/inf (a NaN in the policy's own forward is the skip guard's ``nonfinite`` rule, not this one);
* ``rl_ratio_tail``: completion tokens (sequences for RLOO) whose ratio is above `RATIO_TAIL`;
* ``rl_ratio_max``: the largest finite ratio over the mask (each rank's, summed over ranks: on one rank exact).

They ride in the step's single `GradStats` transfer (`GradStats.add_source`), summed over ranks, so `SkipGuard`'s
``damaged`` rule (`SkipRules.damage_flag`) reads the same numbers on every rank and skips the step everywhere together. The counts are kept
per step label (``state.global_step``); re-runs of the step (`StepTap.replaying`) are not counted.

`watch(trainer)` (called by `hf_stable.stabilize` for the online-RL family) wraps the instance's ``_compute_loss``
and ``_get_per_token_logps_and_entropies`` (the class is left alone): the log-probs the loss was computed from
are kept for the duration of one ``_compute_loss`` call, no second forward.
"""

from __future__ import annotations

import math
import weakref

import torch

RATIO_TAIL = 1000.0  # an importance ratio above this is no sampling noise: the step is damaged
KEYS = ("rl_nonfinite_logps", "rl_ratio_tail", "rl_ratio_max")
_LOG_CAP = 80.0  # exp(80) ~ 5.5e34: stays finite in float32


class DamageTap:
    """Counts a step's damaged log-probs and ratio tail on device (see the module docstring).

    Args:
        trainer: the GRPO / RLOO trainer (held weakly).
        ratio_tail: the importance-ratio bar.
    """

    def __init__(self, trainer, ratio_tail: float = RATIO_TAIL):
        self._trainer = weakref.ref(trainer)
        self.log_bar = math.log(ratio_tail)
        self._step: int | None = None
        self._sums: dict[str, torch.Tensor] | None = None
        self._inside = False
        self._logps: torch.Tensor | None = None

    def _label(self) -> int | None:
        trainer = self._trainer()
        return None if trainer is None else trainer.state.global_step

    def device_scalars(self) -> dict[str, torch.Tensor]:
        """The current step's three numbers (zeros when nothing was counted: every rank sends the same keys)."""
        if self._sums is not None and self._step == self._label():
            return dict(self._sums)
        trainer = self._trainer()
        model = getattr(trainer, "model", None)
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return dict.fromkeys(KEYS, zero)

    def _recording(self) -> bool:
        trainer = self._trainer()
        model = getattr(trainer, "model", None)
        if model is None or not model.training or not torch.is_grad_enabled():
            return False
        from hf_stable.core.step_tap import StepTap

        return not StepTap.shared(model)._paused  # a re-run of the step is not counted twice

    def note(self, inputs: dict, logps: torch.Tensor | None) -> None:
        """Count one micro-batch: its current per-token log-probs `logps` and TRL's prepared `inputs`."""
        mask = inputs.get("completion_mask")
        if logps is None or not isinstance(mask, torch.Tensor) or mask.shape != logps.shape:
            return
        if isinstance(inputs.get("tool_mask"), torch.Tensor):
            mask = mask * inputs["tool_mask"]
        mask = mask.bool()
        logps = logps.detach().float()
        old, seq_old = inputs.get("old_per_token_logps"), inputs.get("old_logps")
        nonfinite = torch.zeros((), device=logps.device)
        for other in (old, inputs.get("sampling_per_token_logps")):
            if isinstance(other, torch.Tensor) and other.shape == logps.shape:
                nonfinite = nonfinite + (~torch.isfinite(other) & mask).sum().float()
        if isinstance(seq_old, torch.Tensor) and seq_old.shape == logps.shape[:1]:
            nonfinite = nonfinite + (~torch.isfinite(seq_old.float()) & mask.any(1)).sum().float()
        if isinstance(old, torch.Tensor) and old.shape == logps.shape:  # GRPO: per token
            log_ratio, valid = logps - old.float(), mask
        elif isinstance(seq_old, torch.Tensor) and seq_old.shape == logps.shape[:1]:  # RLOO: per sequence
            log_ratio = torch.where(mask, logps, 0.0).sum(1) - seq_old.float()
            valid = mask.any(1)
        else:  # on-policy step (TRL uses the detached log-probs): the ratio is exactly 1
            log_ratio, valid = torch.zeros((), device=logps.device), torch.ones((), dtype=torch.bool)
        valid = valid.to(log_ratio.device) & torch.isfinite(log_ratio)
        tail = (valid & (log_ratio > self.log_bar)).sum().float()
        top = torch.where(valid, log_ratio, -math.inf).amax().clamp(max=_LOG_CAP).exp()
        step = self._label()
        if self._sums is None or self._step != step:
            self._step, self._sums = (
                step,
                {"rl_nonfinite_logps": nonfinite, "rl_ratio_tail": tail, "rl_ratio_max": top},
            )
            return
        sums = self._sums
        sums["rl_nonfinite_logps"] = sums["rl_nonfinite_logps"] + nonfinite
        sums["rl_ratio_tail"] = sums["rl_ratio_tail"] + tail
        sums["rl_ratio_max"] = torch.maximum(sums["rl_ratio_max"], top)


def watch(trainer, ratio_tail: float = RATIO_TAIL) -> DamageTap | None:
    """Wrap `trainer`'s ``_compute_loss`` (and its log-prob helper) on the instance and attach a `DamageTap` to the
    model's shared `GradStats`; idempotent. None when the trainer has no such methods (not GRPO / RLOO)."""
    tap = getattr(trainer, "_hf_stable_damage", None)
    if tap is not None:
        return tap
    compute, logps_fn = (getattr(trainer, n, None) for n in ("_compute_loss", "_get_per_token_logps_and_entropies"))
    if compute is None or logps_fn is None or trainer.model is None:
        return None
    tap = DamageTap(trainer, ratio_tail)

    def _get_per_token_logps_and_entropies(*args, **kwargs):
        out = logps_fn(*args, **kwargs)
        if tap._inside and tap._logps is None and isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
            tap._logps = out[0]
        return out

    def _compute_loss(model, inputs):
        tap._inside, tap._logps = True, None
        try:
            loss = compute(model, inputs)
        finally:
            tap._inside = False
        if tap._recording():
            tap.note(inputs, tap._logps)
        tap._logps = None
        return loss

    trainer._get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies
    trainer._compute_loss = _compute_loss
    trainer._hf_stable_damage = tap
    from hf_stable.core.grad_stats import GradStats

    GradStats.shared(trainer.model).add_source("rl_damage", tap.device_scalars)
    return tap
