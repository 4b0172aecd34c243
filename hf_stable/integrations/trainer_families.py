"""What hf_stable knows of the trainers it does not own, by family: which number is the objective, which guard
rules fit it, and how a replay leaves the trainer's own metrics alone.

One place (STYLE.md, "one adapter per trainer family"): the guards and monitors never test a trainer's class; they
are configured by `TrainerFamily.configure` and judge the loss `stabilize` binds. A family is recognised by the
class names in the trainer's (or its `TrainingArguments`') MRO, so neither this module nor `import hf_stable`
imports TRL. A new TRL trainer is one new row of `_FAMILIES`.

Rules per objective (docs/guards.md):

* ``lm`` (`Trainer`, `SFTTrainer`): the model's token NLL, positive; every rule as configured.
* ``preference`` (DPO, KTO): a positive loss (DPO starts at ln 2 and falls towards 0), so the log-based loss spike
  and rise rules apply to it; a batch with chosen and rejected swapped is a loss spike (0.07 -> 2.5). Adaptive
  clipping is off: per-step gradient norms of a preference loss swing with the margin (it scaled 18 of 60 healthy
  DPO steps at LR 2e-3); the trainer's own ``max_grad_norm`` clip stays, after the statistics are read.
* ``online_rl`` (GRPO, RLOO): a loss near 0 and signed (advantages sum to 0 per group), so no loss rule can be
  defined on its logarithm: the loss spike and rise rules are off, the non-finite and grad-norm rules judge the step.
  Adaptive clipping is off for the same reason as above.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerFamily:
    """How hf_stable treats one family of trainers.

    Args:
        name: ``lm``, ``preference`` or ``online_rl``.
        objective: what the guards judge, in words (for notices and docs).
        model_loss: the objective is the model output's ``.loss`` (no `compute_loss` binding needed).
        loss_rules: the log-based loss spike / rise rules apply (the loss is positive).
        adaptive_clip: hf_stable's `ClipGuard` clips this objective's gradients.
        chunked_loss: `StableTrainer`'s chunked LM loss may replace the model's forward in training steps (not when
            the trainer computes its loss from outputs of its own, e.g. TRL's fused log-probs).
        signals: what the trainer computes about its step that hf_stable reads (`trl_signals`): ``None``,
            ``"metrics"`` (TRL's ``_metrics``: DPO, KTO) or ``"generation"`` (those and the generation batch's
            rewards: GRPO, RLOO).
    """

    name: str
    objective: str
    model_loss: bool = True
    loss_rules: bool = True
    adaptive_clip: bool = True
    chunked_loss: bool = True
    signals: str | None = None

    def signal_reader(self, trainer):
        """A `trl_signals.SignalReader` on `trainer` (None when this family computes no signals of its own)."""
        if self.signals is None:
            return None
        from hf_stable.integrations.trl_signals import SignalReader

        return SignalReader(trainer, generates=self.signals == "generation")

    def configure(self, cfg):
        """A copy of the `RunConfig` `cfg` with the rules that fit this objective (`cfg` itself when all fit)."""
        if self.loss_rules and self.adaptive_clip and self.model_loss and self.chunked_loss:
            return cfg
        cfg = copy.deepcopy(cfg)
        guards = cfg.stability.guards
        if not self.loss_rules:
            guards.skip.loss_spike_zscore = None
            guards.skip.loss_rise_rel = None
        if not self.adaptive_clip:
            guards.clipping.enabled = False
        if not (self.model_loss and self.chunked_loss):
            cfg.training_loss.chunked = False  # the trainer's compute_loss, not ours, makes the loss
        return cfg

    @staticmethod
    @contextlib.contextmanager
    def replay(trainer):
        """Around a re-run of `compute_loss` (rollback check, gradient re-runs): TRL trainers append the step's
        metrics to ``trainer._metrics[mode][key]`` in `compute_loss`; what a replay appended is removed again, so the
        logged rewards and accuracies are those of the step the trainer made."""
        metrics = getattr(trainer, "_metrics", None)
        before = (
            {m: {k: len(v) for k, v in d.items()} for m, d in metrics.items()} if isinstance(metrics, dict) else {}
        )
        try:
            yield
        finally:
            for mode, lengths in before.items():
                d = metrics[mode]
                for key in list(d.keys()):
                    if key not in lengths:
                        del d[key]
                    elif isinstance(d[key], list):
                        del d[key][lengths[key] :]


LM = TrainerFamily("lm", "the LM loss (the model's token NLL)")
# TRL's SFTTrainer reads its own fused log-probs from the model's output: the LM loss, without our chunked forward
SFT = TrainerFamily("lm", "the LM loss (the model's token NLL)", chunked_loss=False)
PREFERENCE = TrainerFamily(
    "preference", "the preference loss compute_loss returns", model_loss=False, adaptive_clip=False, signals="metrics"
)
ONLINE_RL = TrainerFamily(
    "online_rl",
    "the policy loss compute_loss returns",
    model_loss=False,
    loss_rules=False,
    adaptive_clip=False,
    signals="generation",
)

# class names (of the trainer or of its TrainingArguments subclass) -> family; the first match in the MRO wins
_FAMILIES = {
    "SFTTrainer": SFT,
    "SFTConfig": SFT,
    "DPOTrainer": PREFERENCE,
    "DPOConfig": PREFERENCE,
    "KTOTrainer": PREFERENCE,
    "KTOConfig": PREFERENCE,
    "GRPOTrainer": ONLINE_RL,
    "GRPOConfig": ONLINE_RL,
    "RLOOTrainer": ONLINE_RL,
    "RLOOConfig": ONLINE_RL,
}


def family_of(obj) -> TrainerFamily:
    """The family of a trainer or of its `TrainingArguments` (`LM` for anything not listed)."""
    for cls in type(obj).__mro__:
        family = _FAMILIES.get(cls.__name__)
        if family is not None:
            return family
    return LM


def trainer_name(obj) -> str:
    """The TRL trainer class that decided `obj`'s family (``DPOConfig`` -> ``DPOTrainer``; else `obj`'s own class
    name), for messages."""
    for cls in type(obj).__mro__:
        if cls.__name__ in _FAMILIES:
            return cls.__name__.removesuffix("Config") + "Trainer" if cls.__name__.endswith("Config") else cls.__name__
    return type(obj).__name__
