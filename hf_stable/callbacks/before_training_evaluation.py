"""`BeforeTrainingEvaluation`: the recipe's evaluation before training, run once training has begun.

Before `trainer.train()` the engine does not exist yet. Under DeepSpeed an evaluation then makes transformers build an
*inference* engine (`deepspeed_init(inference=True)`): ZeRO-1/2 refuse it ("ZeRO inference only makes sense with ZeRO
Stage 3") and under ZeRO-3 the training step later finds no training engine. Under FSDP2 the model is not sharded
yet. So the before-training numbers are taken at `on_train_begin`, when the Trainer has prepared the model, the
optimizer and (on resume) loaded the checkpoint - the same point as `TrainingArguments.eval_on_start`, but with the
recipe's metric prefix (`eval_before_loss`) and exact match.

A resumed run does not evaluate again (the weights are the checkpoint's by then): the first launch's result is part
of this callback's state, which every checkpoint carries (`StabilityCallback`), so `run_summary.json` and the model
card of a resumed run show the numbers measured before its first step.

Example:
    >>> before = BeforeTrainingEvaluation(trainer, tokenizer, data, cfg.evaluation)
    >>> trainer.add_callback(before)
    >>> trainer.train()
    >>> before.result["eval_loss"]
"""

from __future__ import annotations

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.evaluation import evaluate_run
from hf_stable.logging import get_logger

logger = get_logger(__name__)


class BeforeTrainingEvaluation(StabilityCallback):
    """Eval loss and exact match of the model as training starts (`evaluate_run(..., prefix="before")`).

    Args:
        trainer: the Trainer this callback is added to (it runs `trainer.evaluate`).
        tokenizer, data, eval_cfg: as for `evaluate_run` (`build_data(...)`, the `evaluation:` section).

    Add it last (`trainer.add_callback`), so every other callback has begun when the evaluation fires their
    `on_evaluate` / `on_log`. `result` is `{}` until training begins, and on a resume from a checkpoint written
    without this callback.
    """

    def __init__(self, trainer, tokenizer, data, eval_cfg):
        super().__init__()
        self.trainer, self.tokenizer, self.data, self.eval_cfg = trainer, tokenizer, data, eval_cfg
        self._result: dict = {}
        self._done = False

    @property
    def result(self) -> dict:
        return dict(self._result)

    def state_dict(self) -> dict:
        return {"done": self._done, "result": self._result}

    def load_state_dict(self, state: dict) -> None:
        self._done = bool(state.get("done", False))
        self._result = dict(state.get("result") or {})

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)  # restores the first launch's result on resume
        if self._done:
            return
        if state.global_step > 0:  # resumed from a checkpoint that does not hold the result (or not ours)
            logger.warning(
                "before: no evaluation before training in checkpoint (step %d); not re-run", state.global_step
            )
            self._done = True
            return
        self._result = evaluate_run(self.trainer, self.tokenizer, self.data, self.eval_cfg, prefix="before")
        self._done = True
        self._save_into(state)  # the next checkpoint carries it even if training stops before a step ends
