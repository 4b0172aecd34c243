"""Optimizer phases inside the stock Trainer: AdamW -> SGD -> Lion at configured steps, the factory's groups and LR
multipliers kept, momentum carried, and a resume mid-phase restoring the right optimizer and its state."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_stable.callbacks.guards import LRControl, OptimizerPhaseGuard
from hf_stable.callbacks.guards.lr_control import unwrap_optimizer
from hf_stable.compat import fused_optimizer_device_types
from hf_stable.config import OptimConfig
from hf_stable.config.guards import OptimizerPhasesConfig, PhaseConfig
from hf_stable.core.events import read_events
from hf_stable.errors import ConfigError
from hf_stable.optim import build_optimizer
from hf_stable.optim.phases import PhasedOptimizer, wrap_for_phases
from tests.dist_scripts.guards_common import tiny_lora_llama, token_data, training_args

CPU_FUSED = "cpu" in fused_optimizer_device_types()

PHASES = OptimizerPhasesConfig(
    enabled=True,
    phases=[
        PhaseConfig("adamw", until_step=3),
        PhaseConfig("sgd", until_step=6, lr_scale=10.0),
        PhaseConfig("lion", lr_scale=0.3),
    ],
)


class PhaseRecorder(TrainerCallback):
    def __init__(self):
        self.kind, self.used_lr, self.sched_lr, self.groups = {}, {}, {}, {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        opt = unwrap_optimizer(optimizer)
        step = state.global_step + 1
        self.kind[step] = type(opt.current).__name__
        self.used_lr[step] = [g["lr"] for g in opt.param_groups]
        self.groups[step] = [(g["name"], g["initial_lr"], g["weight_decay"]) for g in opt.param_groups]

    def on_step_end(self, args, state, control, lr_scheduler=None, **kw):
        self.sched_lr[state.global_step] = lr_scheduler.get_last_lr()


def _run(out, resume=None, max_steps=8):
    model = tiny_lora_llama()
    args = training_args(out, max_steps=max_steps, save_strategy="steps", save_steps=4, lr_scheduler_type="linear")
    opt = wrap_for_phases(build_optimizer(model, OptimConfig(lora_plus_ratio=4.0), args), PHASES)
    lr = LRControl()
    rec = PhaseRecorder()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=token_data(64),
        optimizers=(opt, None),
        callbacks=[OptimizerPhaseGuard(lr, PHASES), lr, rec],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, rec, model


def test_phases_switch_keep_groups_and_lr_multipliers_and_resume(tmp_path):
    _trainer, rec, model = _run(tmp_path / "full")
    adamw = "FusedAdamW" if CPU_FUSED else "AdamW"  # the factory's AdamW: torch's fused kernel where it runs
    assert [rec.kind[s] for s in range(1, 9)] == [adamw] * 3 + ["SGD"] * 3 + ["Lion"] * 2
    assert all(rec.groups[s] == rec.groups[1] for s in range(1, 9))  # names, base LRs (LoRA+ x4), decay kept
    assert len({g[1] for g in rec.groups[1]}) == 4  # 2 layers (LLRD) x LoRA A/B (LoRA+): four base LRs kept
    for step, scale in ((2, 1.0), (5, 10.0), (8, 0.3)):  # LR = schedule x phase factor, per group
        assert rec.used_lr[step] == pytest.approx([scale * x for x in rec.sched_lr[step - 1]]), step
    assert [e["current"] for e in read_events(tmp_path / "full") if e["kind"] == "optimizer_switch"] == ["sgd", "lion"]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.isfinite(w).all() for w in weights.values())

    # resume in the SGD phase: the checkpoint restores the phase, the SGD momentum and the phase LR factor
    _trainer2, rec2, model2 = _run(tmp_path / "res", resume=str(tmp_path / "full" / "checkpoint-4"))
    assert [rec2.kind[s] for s in range(5, 9)] == ["SGD"] * 2 + ["Lion"] * 2
    assert rec2.used_lr[5] == pytest.approx(rec.used_lr[5])
    for name, p in model2.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), weights[name], rtol=1e-5, atol=1e-6)


def test_carry_momentum_seeds_sgd_and_lion_from_adamw():
    model = tiny_lora_llama()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = PhasedOptimizer(
        torch.optim.AdamW([{"params": params, "lr": 1e-3, "weight_decay": 0.0}]),
        ["adamw", "sgd", "lion"],
        OptimConfig(sgd_momentum=0.9),
    )
    for _ in range(2):
        model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
        opt.step()
        opt.zero_grad()
    exp_avg = {id(p): opt.state[p]["exp_avg"].clone() for p in params}
    opt.switch(1)
    assert type(opt.current).__name__ == "SGD" and opt.param_groups[0]["momentum"] == 0.9
    assert "betas" not in opt.param_groups[0]
    for p in params:
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], exp_avg[id(p)] / 0.1)
    opt.switch(2)
    for p in params:
        torch.testing.assert_close(opt.state[p]["exp_avg"], exp_avg[id(p)], rtol=1e-6, atol=1e-9)
    saved = opt.state_dict()
    fresh = PhasedOptimizer(
        torch.optim.AdamW([{"params": params, "lr": 1e-3, "weight_decay": 0.0}]), ["adamw", "sgd", "lion"]
    )
    fresh.load_state_dict(saved)
    assert fresh.phase == 2 and type(fresh.current).__name__ == "Lion"


def test_dloss_trigger_and_wrong_optimizer_is_an_error(tmp_path):
    phases = [PhaseConfig("adamw", until_dloss_below=0.05), PhaseConfig("lion")]
    guard = OptimizerPhaseGuard(LRControl(), phases=phases, dloss_ema_beta=0.9)
    for i in range(30):
        guard.observe_loss(3.0 - 0.5 * (i % 2))  # |dloss| 0.5: not flat
    assert not guard.due(0, 30)
    for _ in range(40):
        guard.observe_loss(2.0)
    assert guard.due(0, 70) and guard.dloss_ema < 0.05
    model = tiny_lora_llama()
    args = training_args(tmp_path, max_steps=1)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=token_data(8),
        callbacks=[OptimizerPhaseGuard(LRControl(), phases=PHASES.phases)],
    )
    with pytest.raises(ConfigError, match="PhasedOptimizer"):
        trainer.train()


def test_switch_back_to_adamw_keeps_the_factorys_betas_eps_and_fp16_guard(tmp_path):
    model = tiny_lora_llama()
    args = training_args(tmp_path, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    cfg = OptimConfig(sgd_momentum=0.9)
    built = build_optimizer(model, cfg, args)
    phases = OptimizerPhasesConfig(enabled=True, phases=[PhaseConfig("sgd", until_step=2), PhaseConfig("adamw")])
    opt = wrap_for_phases(build_optimizer(model, cfg, args), phases, cfg, args)
    assert type(opt.current).__name__ == "SGD"
    opt.switch(1)
    assert isinstance(opt.current, torch.optim.AdamW)
    for key in ("betas", "eps", "fused", "foreach"):
        assert opt.current.defaults[key] == built.defaults[key], key
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.param_groups[0]["eps"] == 1e-6

    # without args, a factory-built AdamW first phase lends its betas/eps to a later AdamW phase
    again = PhasedOptimizer(build_optimizer(model, cfg, args), ["adamw", "sgd", "adamw"], cfg)
    again.switch(1)
    again.switch(2)
    assert again.param_groups[0]["betas"] == (0.8, 0.95) and again.param_groups[0]["eps"] == 1e-6

    # the fp16 eps guard of the factory applies to a switch too
    from hf_stable.optim import resolve_hyperparameters

    hp = resolve_hyperparameters(lr=1e-3, eps=1e-8, fp16=True)
    fp16 = PhasedOptimizer(build_optimizer(model, cfg, args), ["sgd", "adamw"], cfg, hyperparameters=hp)
    with pytest.warns(UserWarning, match="fp16_eps_min"):
        fp16.switch(1)
    assert fp16.param_groups[0]["eps"] == cfg.fp16_eps_min
