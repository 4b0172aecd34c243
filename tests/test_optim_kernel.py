"""The factory's AdamW kernel: torch's fused AdamW for every group layout it makes (foreach where fused cannot run),
and a Trainer resume with it lands bit for bit on the uninterrupted run's weights and optimizer state."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_stable.compat import fused_optimizer_device_types
from hf_stable.config import OptimConfig
from hf_stable.optim import FusedAdamW, build_optimizer
from hf_stable.optim.factory import adamw_kernel
from tests.helpers import make_tiny_model

CPU_FUSED = "cpu" in fused_optimizer_device_types()
LAYOUTS = {
    "llrd_no_decay": {"llrd_decay": 0.8},  # full fine-tune: one group per depth, decay and no-decay apart
    "one_decay_split": {"llrd_decay": 1.0},  # full fine-tune without the ladder: decay / no-decay only
    "lora_plus": {"llrd_decay": 0.9, "lora_plus_ratio": 8.0},  # LoRA A / B per depth
}


def _model(tokenizer, layout: str, layers: int = 2):
    model = make_tiny_model("llama", tokenizer, num_hidden_layers=layers)
    if layout == "lora_plus":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    return model


@pytest.mark.skipif(not CPU_FUSED, reason="this torch has no fused AdamW on CPU")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_auto_builds_fused_adamw_for_every_group_layout(tokenizer, layout):
    model = _model(tokenizer, layout)
    opt = build_optimizer(model, OptimConfig(**LAYOUTS[layout]), lr=1e-3, weight_decay=0.01)
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) >= 2
    assert all(g["fused"] is True and not g["foreach"] for g in opt.param_groups)
    decays = {g["weight_decay"] for g in opt.param_groups}
    assert decays == {0.0, 0.01} if layout != "lora_plus" else 0.01 in decays  # the no-decay groups are kept
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    trained = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in trained]
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    moved = sum(not torch.equal(a, p) for a, p in zip(before, trained, strict=True))
    assert moved == len(trained)  # every group was stepped (LoRA B starts at zero and moves by its gradient)
    assert all(torch.isfinite(p).all() for p in trained)
    steps = {opt.state[p]["step"].dtype for p in trained}
    assert steps == {torch.float32}  # the fused kernel's step counter: a float32 tensor per parameter


def test_foreach_where_fused_cannot_run_and_forced_kernels():
    meta = torch.nn.Linear(4, 4, device="meta")  # no fused kernel for the meta device
    groups = [{"params": list(meta.parameters())}]
    assert adamw_kernel(OptimConfig(), groups) == {"foreach": True}
    assert adamw_kernel(OptimConfig(adamw_impl="for_loop"), groups) == {"foreach": False}
    assert adamw_kernel(OptimConfig(adamw_impl="foreach"), groups) == {"foreach": True}
    cpu = [{"params": list(torch.nn.Linear(4, 4).parameters())}]
    assert adamw_kernel(OptimConfig(), cpu) == ({"fused": True} if CPU_FUSED else {"foreach": True})
    assert adamw_kernel(OptimConfig(adamw_impl="fused"), cpu) == {"fused": True}


class _Snapshot(TrainerCallback):
    def __init__(self, at):
        self.at, self.state = at, None

    def on_train_begin(self, args, state, control, optimizer=None, **kw):
        if self.at == "begin":
            self.state = copy.deepcopy(optimizer.state_dict())

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        if self.at == state.global_step:
            self.state = copy.deepcopy(optimizer.state_dict())


def _train(tokenizer, out, snapshot, resume=None):
    model = _model(tokenizer, "llrd_no_decay", layers=2)
    ids = torch.randint(3, 512, (24, 16), generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(
        str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.01,
        warmup_steps=2,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    optimizer = build_optimizer(model, OptimConfig(llrd_decay=0.8), args)
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None), callbacks=[snapshot])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.skipif(not CPU_FUSED, reason="this torch has no fused AdamW on CPU")
def test_fused_adamw_resumes_bit_for_bit(tokenizer, tmp_path):
    full = _Snapshot(at=3)
    trainer, weights_full = _train(tokenizer, tmp_path / "full", full)
    assert trainer.optimizer.optimizer.defaults["fused"] is True
    resumed = _Snapshot(at="begin")
    _, weights_resumed = _train(tokenizer, tmp_path / "resumed", resumed, resume=str(tmp_path / "full/checkpoint-3"))
    assert resumed.state["param_groups"] == full.state["param_groups"]
    assert set(resumed.state["state"]) == set(full.state["state"])
    for idx, saved in full.state["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed.state["state"][idx][key], saved[key]), (idx, key)
    assert weights_resumed.keys() == weights_full.keys()
    for name, w in weights_full.items():  # three more steps from the restored state: the same bits
        assert torch.equal(weights_resumed[name], w), name


def _ladder(seed: int, dtype=torch.float32):
    """LoRA-like tensors in four groups (two LRs x decay / no decay), one without a gradient."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in ((8, 32), (32, 8)) * 4]
    groups = [
        {"params": params[0:2], "lr": 1e-3, "weight_decay": 0.01},
        {"params": params[2:4], "lr": 1.6e-2, "weight_decay": 0.01},
        {"params": params[4:6], "lr": 9e-4, "weight_decay": 0.0},
        {"params": params[6:8], "lr": 1.44e-2, "weight_decay": 0.0},
    ]
    return params, groups


def _step_both(steps: int, **step_kw):
    """torch's fused AdamW and FusedAdamW from the same start, fed the same gradients; returns both."""
    a_params, a_groups = _ladder(0)
    b_params, b_groups = _ladder(0)
    torch_opt = torch.optim.AdamW(a_groups, lr=1e-3, fused=True)
    ours = FusedAdamW(b_groups, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, (a, b) in enumerate(zip(a_params, b_params, strict=True)):
            g = None if (i == 5 and step % 2) else torch.randn(a.shape, generator=gen)  # one tensor skips a step
            a.grad, b.grad = (None, None) if g is None else (g.clone(), g.clone())
        torch_opt.step(**step_kw.get("torch", {}))
        ours.step(**step_kw.get("ours", {}))
    return (a_params, torch_opt), (b_params, ours)


@pytest.mark.skipif(not CPU_FUSED, reason="this torch has no fused AdamW on CPU")
def test_fused_adamw_is_torch_fused_adamw_bit_for_bit():
    (a_params, torch_opt), (b_params, ours) = _step_both(7)
    for a, b in zip(a_params, b_params, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch_opt.state[a][key], ours.state[b][key]), key
    assert not torch.equal(a_params[1], _ladder(0)[0][1])  # it moved
    # the state is torch's: ours loads into torch's class and both step on identically
    again = torch.optim.AdamW(_ladder(0)[1], lr=1e-3, fused=True)
    again.load_state_dict(ours.state_dict())
    assert again.state_dict()["param_groups"] == torch_opt.state_dict()["param_groups"]


@pytest.mark.skipif(not CPU_FUSED, reason="this torch has no fused AdamW on CPU")
def test_fused_adamw_runs_torchs_own_step_for_what_the_short_path_does_not_cover(monkeypatch):
    import hf_stable.optim.fused_adamw as fused

    calls = []
    real = fused._TORCH_STEP
    monkeypatch.setattr(fused, "_TORCH_STEP", lambda opt, closure=None: calls.append(closure) or real(opt, closure))
    params, groups = _ladder(2)
    opt = FusedAdamW(groups, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # first step: torch creates the state
    assert len(calls) == 1
    opt.step()  # short path
    assert len(calls) == 1
    loss = opt.step(closure=lambda: torch.tensor(3.0))  # a closure: torch's step, its loss returned
    assert len(calls) == 2 and float(loss) == 3.0
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(0.0)  # what a GradScaler sets
    opt.step()
    assert len(calls) == 3
    del opt.grad_scale, opt.found_inf
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)  # a tensor LR
    opt.step()
    assert len(calls) == 4
    assert all(torch.isfinite(p).all() for p in params)
    # hooks run once per step whichever path ran
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append("pre"))
    opt.param_groups[0]["lr"] = 1e-3
    opt.step()
    opt.step(closure=lambda: None)
    assert seen == ["pre", "pre"]


def test_factory_builds_fused_adamw_class_only_for_the_fused_kernel(tokenizer):
    model = _model(tokenizer, "lora_plus")
    fused_opt = build_optimizer(model, OptimConfig(adamw_impl="fused"), lr=1e-3)
    foreach_opt = build_optimizer(model, OptimConfig(adamw_impl="foreach"), lr=1e-3)
    assert type(fused_opt) is FusedAdamW and fused_opt.defaults["fused"] is True
    assert type(foreach_opt) is torch.optim.AdamW and foreach_opt.defaults["foreach"] is True
