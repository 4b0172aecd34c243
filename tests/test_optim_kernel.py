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
from hf_stable.optim import build_optimizer
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
