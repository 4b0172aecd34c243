"""`ObjectiveNotice`: says once, at train start, when the guards judge a loss that is not the one the trainer
optimizes.

`build_callbacks` alone attaches to any `Trainer`; the guards then read the model output's ``.loss``. For TRL's
preference and RL trainers that is the NLL TRL asks for while computing log-probs (6-10 on a tiny model), not the
DPO loss (0.07-0.69) or the GRPO loss (~0): a batch with chosen and rejected swapped has the same NLL and is not
seen. `hf_stable.stabilize(trainer)` binds the trainer's `compute_loss` instead; this notice points there.
"""

from __future__ import annotations

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.core.step_tap import StepTap
from hf_stable.integrations.trainer_families import family_of, trainer_name


class ObjectiveNotice(StabilityCallback):
    """One `objective_not_judged` warning at train start when the trainer's objective is not the model's loss and
    no `stabilize(trainer)` bound it (the family comes from the `TrainingArguments` class: `DPOConfig` ...).

    Example:
        >>> trainer = DPOTrainer(..., callbacks=[*build_callbacks(cfg, args), ObjectiveNotice()])
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        family = family_of(args)
        if not self.enabled or family.model_loss or model is None or StepTap.shared(model).objective is not None:
            return
        name = trainer_name(args)
        self.event(
            state.global_step,
            "objective_not_judged",
            f"{name}: hf_stable's guards judge the model output's loss (the token NLL of the sequences), not "
            f"{family.objective}; call hf_stable.stabilize(trainer) after building the trainer to judge that loss "
            "(and to read pre-clip gradients)",
            severity="warning",
        )
