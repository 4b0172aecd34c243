"""Batch warmup / the thermal guard with the recipe's Trainer: the data is planned for a changing accumulation
(`EpochStreamSampler`: reshuffled epochs back to back until the plan's micro-batches), and a resume skips exactly
the micro-batches consumed, so it continues bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_stable.callbacks.guards.accumulation_control import AccumulationControl
from hf_stable.callbacks.guards.batch_warmup_guard import BatchWarmupGuard
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.callbacks.guards.thermal_guard import ThermalGuard
from hf_stable.data.epochs import EpochStreamSampler
from hf_stable.errors import ConfigError
from hf_stable.trainer import StableTrainer
from tests.dist_scripts.guards_common import tiny_lora_llama, token_data, trainable, training_args


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


# ---- the recipe (scripts/finetune.py): opt-in guards switched on from the command line, nothing else -----------

WARMUP = [
    "--stability.guards.batch_warmup.enabled",
    "true",
    "--stability.guards.batch_warmup.target_accumulation",
    "4",
]


def _events(out: Path) -> list[dict]:
    from hf_stable.core.events import read_events

    return read_events(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recipe_runs_batch_warmup_snr_and_optimizer_phases_together_for_200_steps(tmp_path):
    import json

    from tests.dist_scripts.harness import launch, recipe_args

    out = tmp_path / "out"
    phases = "[{name: adamw, until_step: 60}, {name: sgd, until_step: 120, lr_scale: 10}, {name: lion, lr_scale: 0.3}]"
    # 64 rows: the plan (1 x 25, 2 x 25, 4 x 150 micro-batches of 8) is ~11 data epochs, which the stock Trainer's
    # plan (one epoch per 8 steps at accumulation 1) cannot feed
    args = (
        recipe_args(out, steps=200, n_train=64)
        + WARMUP
        + [
            "--stability.guards.batch_warmup.double_every",
            "25",
            "--stability.guards.snr.enabled",
            "true",
            "--stability.guards.snr.interval",
            "20",
            "--stability.guards.phases.enabled",
            "true",
            "--stability.guards.phases.phases",
            phases,
        ]
    )
    run = launch(args, out, timeout=540)
    assert run.returncode == 0, run.tail()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 200
    events = _events(out)
    accumulation = [e["value"] for e in events if e["kind"] == "accumulation_changed"]
    assert accumulation == [2, 4]  # doubled twice and held at the target to the end
    history = state["log_history"]
    assert [h["batch/accumulation"] for h in history if "batch/accumulation" in h][-1] == 4
    switches = [e["message"] for e in events if e["kind"] == "optimizer_switch"]
    assert len(switches) == 2 and "adamw -> sgd" in switches[0] and "sgd -> lion" in switches[1]
    ratios = [h["lr/snr_ratio"] for h in history if "lr/snr_ratio" in h]
    assert len(ratios) >= 5  # checked every 20 steps (once the EMA has history), logged
    # the SNR rule cuts the LR only far outside the healthy band (> 1.5) and never lifts it above the schedule
    adjusted = [e["factor"] for e in events if e["kind"] == "lr_adjusted"]
    assert bool(adjusted) == any(r > 1.5 for r in ratios) and all(f <= 1.0 for f in adjusted)
    losses = [h["loss"] for h in history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learned through every phase and accumulation change


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recipe_with_batch_warmup_killed_and_resumed_equals_the_uninterrupted_run(tmp_path):
    import json
    import signal

    from tests.dist_scripts.harness import launch, load_adapter, recipe_args, strip_timing

    # accumulation 1, 1, 1, 1, 2, 2, 4 ... (doubling due every 3 steps, applied when aligned); killed while writing
    # checkpoint-8, resumed from checkpoint-6 at accumulation 4: the stock Trainer would skip 6 micro-batches, not 8
    def args(out: Path) -> list[str]:
        return (
            recipe_args(out, steps=12, n_train=32, save_steps=2)
            + WARMUP
            + [
                "--stability.guards.batch_warmup.double_every",
                "3",
            ]
        )

    base = tmp_path / "base"
    uninterrupted = launch(args(base), base)
    assert uninterrupted.returncode == 0, uninterrupted.tail()
    out = tmp_path / "out"
    killed = launch(args(out), out, fault="kill_in_save:8")
    assert killed.returncode == -signal.SIGKILL, killed.tail()
    resumed = launch(args(out), out, tag="resume")
    assert resumed.returncode == 0, resumed.tail()
    assert "checkpoint-6" in resumed.output

    a, b = load_adapter(out), load_adapter(base)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    sa, sb = (json.loads((d / "trainer_state.json").read_text()) for d in (out, base))
    assert [h.get("loss") for h in sa["log_history"]] == [h.get("loss") for h in sb["log_history"]]
    assert strip_timing(sa["stateful_callbacks"]["hf_stable"]) == strip_timing(sb["stateful_callbacks"]["hf_stable"])
    assert sa["stateful_callbacks"]["hf_stable"]["AccumulationControl"]["micro_batches"] == 4 + 4 + 4 * 6
