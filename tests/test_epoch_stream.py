"""Batch warmup / the thermal guard with the recipe's Trainer: the data is planned for a changing accumulation
(`EpochStreamSampler`: reshuffled epochs back to back until the plan's micro-batches), and a resume skips exactly
the micro-batches consumed, so it continues bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
from guards_common import tiny_lora_llama, token_data, trainable, training_args

from hf_stable.callbacks.guards.accumulation import AccumulationControl
from hf_stable.callbacks.guards.batch_warmup import BatchWarmupGuard
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.callbacks.guards.thermal import ThermalGuard
from hf_stable.data.epochs import EpochStreamSampler
from hf_stable.errors import ConfigError
from hf_stable.trainer import StableTrainer


def test_epoch_stream_sampler_reshuffles_each_epoch_covers_every_index_and_plans_its_length():
    sampler = EpochStreamSampler.covering(size=10, samples=25, seed=3)
    assert sampler.epochs == 3 and len(sampler) == 30
    stream = list(sampler)
    assert len(stream) == len(sampler)
    epochs = [stream[i : i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # every sample once per data epoch
    assert len({tuple(e) for e in epochs}) == 3  # a fresh order each epoch
    assert epochs[1] == EpochStreamSampler(10, 1, seed=4).permutation(0)  # epoch e is drawn from seed + e
    assert list(sampler) == stream  # a pure function of the position: every rank, every resume, the same stream
    assert list(EpochStreamSampler(10, 3, seed=4)) != stream
    sampler.set_epoch(1)  # a second Trainer epoch over the stream continues the sequence of data epochs
    assert list(sampler)[:10] == EpochStreamSampler(10, 4, seed=3).permutation(3)
    assert EpochStreamSampler.covering(size=10, samples=10, seed=0).epochs == 1
    assert EpochStreamSampler.covering(size=10, samples=0, seed=0).epochs == 1
    with pytest.raises(ValueError, match="size > 0"):
        EpochStreamSampler(0, 1, seed=0)


class MicroBatches(TrainerCallback):
    """The first token of every training row each optimizer step saw (rows are identified by their start token)."""

    def __init__(self, model):
        self.steps: list[list[list[int]]] = []
        self._step: list[list[int]] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            self._step.append(kwargs["input_ids"][:, 0].tolist())

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(self._step)
        self._step = []


def _warmup_guards(target=4, double_every=2):
    lr = LRControl()
    acc = AccumulationControl(lr, target=target, lr_rule="sqrt")
    return [BatchWarmupGuard(acc, initial_accumulation=1, double_every=double_every), acc, lr], acc


def _train(tmp_path, guards, *, trainer_cls=StableTrainer, rows=24, resume=None, **kw):
    torch.manual_seed(0)
    model = tiny_lora_llama()
    seen = MicroBatches(model)
    args = training_args(tmp_path, max_steps=10, per_device_train_batch_size=2, **kw)
    trainer = trainer_cls(model=model, args=args, train_dataset=token_data(rows), callbacks=[*guards, seen])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, seen, model


def test_stable_trainer_feeds_batch_warmup_past_the_trainers_epoch_plan(tmp_path):
    # 24 rows / batch 2 = 12 micro-batches per data epoch; the plan (1,1,2,2,4 x 6) needs 30: the stock Trainer
    # refuses (it plans one epoch of 12 for accumulation 1), StableTrainer streams 3 reshuffled data epochs.
    guards, _ = _warmup_guards()
    with pytest.raises(ConfigError, match="need 30 micro-batches per rank.*StableTrainer"):
        _train(tmp_path / "stock", guards, trainer_cls=Trainer)
    guards, acc = _warmup_guards()
    trainer, seen, _ = _train(tmp_path / "stable", guards)
    assert trainer.state.global_step == 10
    sizes = [len(step) for step in seen.steps]
    assert sizes == [1, 1, 2, 2, 2, 4, 4, 4, 4, 4]  # the target is reached and held to max_steps (4 waits a step)
    assert acc.history[-1] == (6, 4) and acc.state_dict()["micro_batches"] == sum(sizes) == 28
    assert trainer.args.gradient_accumulation_steps == 1  # put back: a second train() plans as the first did
    sampler = trainer.get_train_dataloader().base_dataloader.batch_sampler.sampler
    assert isinstance(sampler, EpochStreamSampler) and sampler.epochs == 3
    starts = [row["input_ids"][0].item() for row in token_data(24)]
    fed = [start for step in seen.steps for batch in step for start in batch]
    assert fed == [starts[i] for i in list(sampler)[: len(fed)]]  # the rows in the stream's order, none dropped


def test_thermal_guard_with_stable_trainer_plans_for_the_full_target(tmp_path):
    temps = iter([80.0] * 20)  # hot from the first read: 8 -> 6 once aligned
    lr = LRControl()
    acc = AccumulationControl(lr, target=8, lr_rule="linear")
    thermal = ThermalGuard(acc, check_every=2, temperature_fn=lambda: next(temps))
    trainer, seen, _ = _train(tmp_path, [thermal, acc, lr], rows=16)  # 8 micro-batches per data epoch
    assert trainer.state.global_step == 10
    sizes = [len(step) for step in seen.steps]
    assert sizes[:2] == [8, 8] and sizes[-1] == 6  # 16 consumed after step 2, not a multiple of 6 until 48
    sampler = trainer.get_train_dataloader().base_dataloader.batch_sampler.sampler
    assert sampler.epochs == 10  # no plan from the thermal guard: room for the full target, 10 x 8 micro-batches


def test_resume_with_batch_warmup_skips_the_micro_batches_consumed_and_matches_the_uninterrupted_run(tmp_path):
    guards, _ = _warmup_guards()
    _, full_seen, full_model = _train(tmp_path / "full", guards, save_strategy="steps", save_steps=5)
    checkpoint = tmp_path / "full" / "checkpoint-5"
    assert AccumulationControl.saved_micro_batches(_saved_state(checkpoint)) == 1 + 1 + 2 + 2 + 2

    guards, _ = _warmup_guards()
    trainer, seen, model = _train(tmp_path / "resumed", guards, resume=str(checkpoint))
    assert trainer.state.global_step == 10
    assert seen.steps == full_seen.steps[5:]  # same rows, same accumulation (4 from step 6, as uninterrupted)
    full, resumed = trainable(full_model), trainable(model)
    assert all(torch.equal(full[k], resumed[k]) for k in full), "resumed weights differ from the uninterrupted run"


def _saved_state(checkpoint: Path):
    from transformers import TrainerState

    return TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
