"""Precision and memory settings end to end (bf16 autocast, gradient checkpointing with LoRA) and the fp16
loss-scaling helpers of hf_stable.precision with a real GradScaler."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_stable.precision import grad_scaler, loss_scale, step_was_skipped, unscale_gradients
from tests.dist_scripts.harness import baseline_run, launch, load_adapter, recipe_args


def _losses(out) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_on_cpu_trains_under_autocast_end_to_end(tmp_path):
    out = tmp_path / "out"
    run = launch(recipe_args(out) + ["--training.bf16", "true", "--training.use_cpu", "true"], out)
    assert run.returncode == 0, run.tail()
    (probe,) = run.ranks()
    assert probe["train_output_dtypes"] == ["torch.bfloat16"]  # the LM head ran under bf16 autocast
    losses = _losses(out)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    adapter = load_adapter(out)
    assert all(v.dtype == torch.float32 for v in adapter.values())  # trainable weights stay fp32 masters
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # every adapter was trained
    summary = json.loads((out / "run_summary.json").read_text())
    assert math.isfinite(summary["eval_loss_after"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gradient_checkpointing_non_reentrant_with_lora_matches_the_plain_run(tmp_path):
    base = baseline_run()  # same run without checkpointing
    out = tmp_path / "out"
    flags = [
        "--training.gradient_checkpointing",
        "true",
        "--training.gradient_checkpointing_kwargs",
        "{use_reentrant: false}",
    ]
    run = launch(recipe_args(out) + flags, out)
    assert run.returncode == 0, run.tail()
    (probe,) = run.ranks()
    assert probe["gradient_checkpointing"] is True
    adapter, plain = load_adapter(out), load_adapter(base.out)
    # every LoRA tensor got gradients through the checkpointed blocks (lora_B starts at exactly zero)
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    losses = _losses(out)
    assert all(math.isfinite(x) for x in losses)
    # recomputing activations must not change the maths: same losses and weights as without checkpointing
    assert losses == pytest.approx(_losses(base.out), rel=1e-6)
    for key in plain:
        torch.testing.assert_close(adapter[key], plain[key], atol=1e-6, rtol=1e-5)


# ---- fp16 loss scaling helpers (real torch.amp.GradScaler on CPU) -------------------------------------------


@pytest.fixture
def scaled():
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    yield layer, AcceleratedOptimizer(inner, device_placement=False, scaler=scaler), scaler
    AcceleratorState._reset_state(reset_partial_state=True)


def _backward(layer, scaler, optimizer, poison: bool = False):
    optimizer.zero_grad()
    scaler.scale(layer(torch.randn(2, 4)).pow(2).sum()).backward()
    if poison:
        layer.weight.grad[0, 0] = float("inf")


def test_overflow_is_detected_before_and_reported_after_the_skipped_step(scaled):
    layer, opt, scaler = scaled
    _backward(layer, scaler, opt)
    assert unscale_gradients(opt) is False
    opt.step()
    assert step_was_skipped(opt) is False and loss_scale(opt) == 1024.0

    _backward(layer, scaler, opt, poison=True)
    before = layer.weight.detach().clone()
    assert unscale_gradients(opt) is True  # known in on_pre_optimizer_step: the scaler will skip
    opt.step()
    assert step_was_skipped(opt) is True
    assert torch.equal(layer.weight, before) and loss_scale(opt) == 512.0  # no update, scale halved


def test_unscale_gradients_is_idempotent_and_gives_true_gradients(scaled):
    layer, opt, scaler = scaled
    torch.manual_seed(1)
    x = torch.randn(2, 4)
    opt.zero_grad()
    layer(x).pow(2).sum().backward()
    true_grad = layer.weight.grad.clone()
    opt.zero_grad()
    scaler.scale(layer(x).pow(2).sum()).backward()
    assert torch.allclose(layer.weight.grad, true_grad * 1024)  # max_grad_norm=0: still scaled at this hook
    unscale_gradients(opt)
    unscale_gradients(opt)  # a second reader in the same step must not divide again
    torch.testing.assert_close(layer.weight.grad, true_grad)
    opt.step()  # the scaler sees the step was already unscaled and does not unscale twice
    assert step_was_skipped(opt) is False


def test_guard_skip_composes_with_loss_scaling(scaled):
    layer, opt, scaler = scaled
    _backward(layer, scaler, opt)
    opt.step()
    adam_step = opt.optimizer.state[layer.weight]["step"].item()
    _backward(layer, scaler, opt)
    assert unscale_gradients(opt) is False
    for p in layer.parameters():  # what the skip-step guard does in on_pre_optimizer_step
        p.grad = None
    before = layer.weight.detach().clone()
    opt.step()
    assert torch.equal(layer.weight, before)  # no update, no weight decay
    assert opt.optimizer.state[layer.weight]["step"].item() == adam_step  # no AdamW moment update
    assert step_was_skipped(opt) is False and loss_scale(opt) == 1024.0  # not an overflow: the scale is kept


def test_no_loss_scaling_reads_none_and_fp16_on_cpu_has_no_scaler(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    plain = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    assert (grad_scaler(plain), loss_scale(plain), unscale_gradients(plain), step_was_skipped(plain)) == (None,) * 4
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, report_to="none")
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer()
    # documented platform fact: fp16 on CPU is silently plain fp32 (no GradScaler, no fp16 autocast)
    assert trainer.accelerator.scaler is None and loss_scale(trainer.accelerator.prepare(trainer.optimizer)) is None
