"""`StableTrainer`: the same training as the stock Trainer, with one gradient pass per step and pre-clip statistics."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_stable.callbacks.monitors import build_monitors
from hf_stable.config import MonitorsConfig
from hf_stable.core.events import read_events
from hf_stable.trainer import StableTrainer
from tests.dist_scripts.guards_common import Recorder, tiny_lora_llama, token_data, training_args


class _CountNormPasses(TrainerCallback):
    """Counts L2 `torch._foreach_norm` calls (each one reads every gradient) between two optimizer steps; the
    max |g| read at logging steps (an inf-norm on GPUs) is a different statistic and not counted."""

    def __init__(self, monkeypatch):
        self.calls, self.per_step = 0, []
        real = torch._foreach_norm

        def counting(tensors, ord=2, *args, **kwargs):
            self.calls += ord == 2
            return real(tensors, ord, *args, **kwargs)

        monkeypatch.setattr(torch, "_foreach_norm", counting)

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self.calls)
        self.calls = 0


class _GradSnapshot(TrainerCallback):
    """Which trainable parameters hold a non-finite gradient when the optimizer is about to step."""

    def __init__(self):
        self.nonfinite: dict[int, list[str]] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.nonfinite[state.global_step + 1] = [
            n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]


def _train(cls, out, callbacks=(), max_steps=6, **kw):
    model = tiny_lora_llama()
    rec = Recorder(model)
    args = training_args(out, max_steps=max_steps, learning_rate=5e-3, **kw)
    trainer = cls(model=model, args=args, train_dataset=token_data(), callbacks=[*callbacks, rec])
    trainer.train()
    return trainer, rec, model


def _history(trainer, key):
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05])
def test_same_training_and_grad_norm_as_the_stock_trainer(tmp_path, max_grad_norm):
    stock, rec_stock, _ = _train(Trainer, tmp_path / "stock", max_grad_norm=max_grad_norm)
    ours, rec_ours, _ = _train(StableTrainer, tmp_path / "ours", max_grad_norm=max_grad_norm)
    norms_stock, norms_ours = _history(stock, "grad_norm"), _history(ours, "grad_norm")
    assert len(norms_ours) == 6
    for step, value in norms_stock.items():
        assert norms_ours[step] == pytest.approx(value, rel=1e-5), step
    if max_grad_norm:
        assert min(norms_stock.values()) > max_grad_norm  # every step was really clipped
    for name, w in rec_stock.weights[6].items():
        torch.testing.assert_close(rec_ours.weights[6][name], w, rtol=1e-5, atol=1e-7)


def test_one_gradient_pass_per_step_with_every_monitor_on(tmp_path, monkeypatch):
    counts = {}
    for cls in (Trainer, StableTrainer):
        counter = _CountNormPasses(monkeypatch)
        _train(
            cls,
            tmp_path / cls.__name__,
            callbacks=[*build_monitors(MonitorsConfig()), counter],
            max_grad_norm=1.0,
            logging_steps=3,
        )
        counts[cls.__name__] = counter.per_step
        monkeypatch.undo()
    # stock: the Trainer's clip and the monitors each read every gradient; StableTrainer shares one pass
    assert counts["Trainer"] == [2] * 6
    assert counts["StableTrainer"] == [1] * 6


def test_monitors_see_pre_clip_statistics_with_max_grad_norm(tmp_path):
    runs = {}
    for name, cls, clip in (
        ("unclipped", StableTrainer, 0.0),
        ("stable", StableTrainer, 0.05),
        ("stock", Trainer, 0.05),
    ):
        trainer, _, _ = _train(
            cls, tmp_path / name, callbacks=build_monitors(MonitorsConfig()), max_steps=1, max_grad_norm=clip
        )
        runs[name] = (trainer.state.log_history[0], [e["kind"] for e in read_events(tmp_path / name)])
    # step 1 starts from the same weights: the same gradient. StableTrainer reports it before its clip ...
    unclipped, stable, stock = (runs[k][0] for k in ("unclipped", "stable", "stock"))
    assert stable["grad/norm_global"] == pytest.approx(unclipped["grad/norm_global"], rel=1e-6)
    assert stable["grad/max_abs"] == pytest.approx(unclipped["grad/max_abs"], rel=1e-5)
    assert stable["grad/norm_global"] > 0.05
    assert "monitor_notice" not in runs["stable"][1]
    # ... the stock Trainer has clipped before any callback reads, and says the numbers are post-clip
    assert stock["grad/norm_global"] == pytest.approx(0.05, rel=1e-3)
    assert stock["grad/max_abs"] < 0.5 * unclipped["grad/max_abs"]
    assert "monitor_notice" in runs["stock"][1]


def test_clip_guard_notice_says_what_the_monitors_really_see(tmp_path):
    """With the Trainer's clip left on, ClipGuard warns of the double clip; the notice's claim about the monitors'
    statistics is checked against what they logged: pre-clip under StableTrainer, post-clip under the stock one."""
    from hf_stable.callbacks.guards import ClipGuard

    for cls in (StableTrainer, Trainer):
        out = tmp_path / cls.__name__
        trainer, _, _ = _train(
            cls, out, callbacks=[*build_monitors(MonitorsConfig()), ClipGuard()], max_steps=1, max_grad_norm=0.05
        )
        (notice,) = [e["message"] for e in read_events(out) if e["kind"] == "guard_notice"]
        logged = trainer.state.log_history[0]["grad/norm_global"]
        assert "clipped twice" in notice and "set max_grad_norm=0" in notice
        if cls is StableTrainer:
            assert logged > 0.1 and "statistics stay pre-clip" in notice and "post-clip" not in notice
        else:
            assert logged == pytest.approx(0.05, rel=1e-3) and "statistics and this guard see post-clip" in notice


class _NanGrad(TrainerCallback):
    """A NaN gradient in one LoRA tensor at one step (through a tensor hook)."""

    def __init__(self, model, name, step):
        self.param, self.step, self.handle = dict(model.named_parameters())[name], step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.handle = self.param.register_hook(lambda g: torch.full_like(g, math.nan))

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()


def test_a_nan_gradient_is_not_smeared_over_every_tensor(tmp_path):
    poisoned = "base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight"
    seen = {}
    for cls in (Trainer, StableTrainer):
        model = tiny_lora_llama()
        snap = _GradSnapshot()
        args = training_args(tmp_path / cls.__name__, max_steps=3, max_grad_norm=0.0)
        trainer = cls(
            model=model,
            args=args,
            train_dataset=token_data(),
            callbacks=[*build_monitors(MonitorsConfig()), _NanGrad(model, poisoned, 2), snap],
        )
        trainer.train()
        seen[cls.__name__] = (snap.nonfinite[2], _history(trainer, "grad/nonfinite_total")[2])
    n_trainable = sum(1 for p in tiny_lora_llama().parameters() if p.requires_grad)
    # the stock Trainer's inf-clip multiplies every gradient by inf / NaN = NaN before callbacks run
    assert len(seen["Trainer"][0]) == n_trainable and seen["Trainer"][1] == n_trainable
    # StableTrainer leaves them alone: the monitors count exactly the poisoned tensor
    assert seen["StableTrainer"] == ([poisoned], 1.0)


class _Unfreeze(TrainerCallback):
    """Unfreezes the final norm at one step (gradual unfreezing): it gets gradients from then on."""

    def __init__(self, model, step):
        self.param, self.step = model.base_model.model.model.norm.weight, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.param.requires_grad_(True)


def test_grad_norm_follows_parameters_unfrozen_mid_run(tmp_path):
    norms = {}
    for cls in (Trainer, StableTrainer):
        model = tiny_lora_llama()
        args = training_args(tmp_path / cls.__name__, max_steps=5, max_grad_norm=0.05)
        trainer = cls(
            model=model,
            args=args,
            train_dataset=token_data(),
            callbacks=[*build_monitors(MonitorsConfig()), _Unfreeze(model, 3)],
        )
        trainer.train()
        norms[cls.__name__] = _history(trainer, "grad_norm")
    assert len(norms["StableTrainer"]) == 5
    for step, value in norms["Trainer"].items():  # the stock clip counts every gradient, the new one included
        assert norms["StableTrainer"][step] == pytest.approx(value, rel=1e-5), step
