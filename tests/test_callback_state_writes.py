"""`StableTrainer` writes the hf_stable callbacks' resume state into the TrainerState just before each checkpoint
(not at every step's end, a cost paid every step), and the checkpoint carries exactly the state of that step."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_stable.callbacks.base import STATE_KEY
from hf_stable.callbacks.guards import build_guards
from hf_stable.callbacks.monitors import build_monitors
from hf_stable.config import GuardsConfig, MonitorsConfig
from hf_stable.trainer import StableTrainer
from tests.helpers import make_tiny_model


class Spy(TrainerCallback):
    """What the TrainerState holds for hf_stable after each step's callbacks, and each callback's state when saved."""

    def __init__(self, watched):
        self.watched = watched
        self.in_state: dict[int, bool] = {}
        self.at_save: dict[int, dict] = {}
        self.at_begin: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_begin = {cb.state_key: json.loads(json.dumps(cb.state_dict())) for cb in self.watched}

    def on_step_end(self, args, state, control, **kwargs):
        self.in_state[state.global_step] = STATE_KEY in (state.stateful_callbacks or {})

    def on_save(self, args, state, control, **kwargs):
        self.at_save[state.global_step] = {
            cb.state_key: json.loads(json.dumps(cb.state_dict())) for cb in self.watched
        }


def _run(tokenizer, out, trainer_cls, resume=None):
    model = get_peft_model(
        make_tiny_model("llama", tokenizer, seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    callbacks = [*build_monitors(MonitorsConfig()), *build_guards(GuardsConfig())]
    spy = Spy(callbacks)
    ids = torch.randint(3, model.config.vocab_size, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    args = TrainingArguments(
        str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        max_grad_norm=0.0,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[*callbacks, spy])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, callbacks, spy


@pytest.mark.parametrize("trainer_cls", [StableTrainer, Trainer])
def test_callback_state_is_written_at_checkpoints_under_stable_trainer(tokenizer, tmp_path, trainer_cls):
    trainer, callbacks, spy = _run(tokenizer, tmp_path / "full", trainer_cls)
    # StableTrainer: nothing written after step 1 or 2 (no checkpoint yet); the stock Trainer: every step
    assert [spy.in_state[s] for s in (1, 2)] == ([False, False] if trainer_cls is StableTrainer else [True, True])
    for step in (3, 6):
        saved = json.loads((tmp_path / "full" / f"checkpoint-{step}" / "trainer_state.json").read_text())
        saved = saved["stateful_callbacks"][STATE_KEY]
        assert set(saved) == {cb.state_key for cb in callbacks}
        assert saved == spy.at_save[step], step  # the state of the step the checkpoint is of
    assert len(spy.at_save[3]["LossMonitor"]["history"]) == 3
    final = trainer.state.stateful_callbacks[STATE_KEY]  # train end writes it too (trainer.save_state())
    assert json.loads(json.dumps(final)) == spy.at_save[6]
    if trainer_cls is StableTrainer:  # a resume restores the checkpoint's state in every callback
        _, _, resumed = _run(tokenizer, tmp_path / "res", trainer_cls, resume=str(tmp_path / "full" / "checkpoint-3"))
        assert resumed.at_begin == spy.at_save[3]
        assert resumed.at_save[6]["LossMonitor"] == spy.at_save[6]["LossMonitor"]
