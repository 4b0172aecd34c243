"""The factory's optimizers in real training: loss goes down, the Trainer's scheduler keeps every group's LR,
and optimizer state survives a checkpoint save → resume."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_stable.config import OptimConfig
from hf_stable.optim import build_optimizer, param_groups, trainer_optimizer_factory
from tests.helpers import make_tiny_model

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _lora_llama(tokenizer, **sizes):
    return get_peft_model(make_tiny_model("llama", tokenizer, **sizes), LoraConfig(r=4, target_modules=TARGETS))


@pytest.mark.parametrize("name, lr", [("adamw", 1e-3), ("lion", 3e-4), ("sgd", 0.1)])
def test_each_optimizer_reduces_loss_on_a_fixed_batch(tokenizer, name, lr):
    model = _lora_llama(tokenizer)
    batch = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OptimConfig(name=name), lr=lr, weight_decay=0.01)
    losses = []
    for _ in range(20):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.15, (name, losses[0], losses[-1])


def _dataset(n=32, length=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (n, length), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


class _Recorder(TrainerCallback):
    """Copies of the optimizer's per-group LRs after each step and of its state at chosen moments."""

    def __init__(self, snapshot_at=None):
        self.lrs = {}
        self.snapshot_at = snapshot_at
        self.state = None

    def on_train_begin(self, args, state, control, optimizer=None, **kw):
        if self.snapshot_at == "begin":
            self.state = copy.deepcopy(optimizer.state_dict())

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        self.lrs[state.global_step] = [g["lr"] for g in optimizer.param_groups]
        if self.snapshot_at == state.global_step:
            self.state = copy.deepcopy(optimizer.state_dict())


def _train(tokenizer, out, max_steps, recorder, resume=None):
    model = _lora_llama(tokenizer, num_hidden_layers=3)
    args = TrainingArguments(
        str(out),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="constant_with_warmup",
        save_strategy="steps",
        save_steps=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    optimizer = build_optimizer(model, OptimConfig(llrd_decay=0.5, lora_plus_ratio=4.0), args)
    trainer = Trainer(
        model=model, args=args, train_dataset=_dataset(), optimizers=(optimizer, None), callbacks=[recorder]
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_trainer_schedule_keeps_group_lrs_and_state_survives_resume(tokenizer, tmp_path):
    full = _Recorder(snapshot_at=4)
    trainer, weights_full = _train(tokenizer, tmp_path / "full", 6, full)

    # Configured values, computed here from the formula: lr * 0.5^(L-1-i), B = 4 x A.
    expected = {f"layer_{i}.lora_A": 1e-3 * 0.5 ** (2 - i) for i in range(3)}
    expected.update({f"layer_{i}.lora_B": 4 * 1e-3 * 0.5 ** (2 - i) for i in range(3)})
    names = [g["name"] for g in trainer.optimizer.param_groups]
    assert sorted(names) == sorted(expected)
    configured = [expected[n] for n in names]
    assert full.lrs[1] == pytest.approx([0.5 * v for v in configured])  # mid-warmup: every group scaled alike
    for step in (2, 3, 6):  # after warmup: exactly the configured per-group values
        assert full.lrs[step] == pytest.approx(configured, rel=1e-12)
    assert trainer.state.log_history[3]["learning_rate"] == pytest.approx(1e-3)  # group 0 carries the base LR

    resumed = _Recorder(snapshot_at="begin")
    checkpoint = str(tmp_path / "full" / "checkpoint-4")
    trainer2, weights_resumed = _train(tokenizer, tmp_path / "resumed", 6, resumed, resume=checkpoint)
    assert resumed.state["param_groups"] == full.state["param_groups"]  # names, lrs, initial_lr, decay
    assert set(resumed.state["state"]) == set(full.state["state"]) and len(full.state["state"]) == 3 * len(TARGETS) * 2
    for idx, saved in full.state["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed.state["state"][idx][key], saved[key]), (idx, key)
    # Two more steps from the restored state land on the same weights as the uninterrupted run.
    for name, w in weights_full.items():
        torch.testing.assert_close(weights_resumed[name], w, rtol=1e-5, atol=1e-7)
    assert [g["lr"] for g in trainer2.optimizer.param_groups] == pytest.approx(configured)


def test_trainer_optimizer_factory_path(tokenizer, tmp_path):
    """`optimizer_cls_and_kwargs=` (the FSDP-compatible form) builds the same groups inside the Trainer."""
    model = _lora_llama(tokenizer)
    args = TrainingArguments(str(tmp_path), learning_rate=2e-4, report_to=[], use_cpu=True, max_steps=1)
    cfg = OptimConfig(name="lion", lora_plus_ratio=2.0)
    factory = trainer_optimizer_factory(cfg, args)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(8), optimizer_cls_and_kwargs=factory)
    opt = trainer.create_optimizer()
    assert type(opt).__name__ == "Lion"
    want = [(g["name"], g["lr"]) for g in param_groups(model, cfg, args)]
    assert [(g["name"], g["lr"]) for g in opt.param_groups] == want
