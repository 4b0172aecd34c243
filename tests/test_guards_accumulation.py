"""Batch-size warmup and the thermal guard change gradient accumulation mid-run inside the stock Trainer; the
per-token loss normalisation stays exact (checked against one forward over the step's micro-batches)."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_stable.callbacks.guards import build_guards, guard_training_overrides
from hf_stable.callbacks.guards.accumulation_control import AccumulationControl
from hf_stable.callbacks.guards.batch_warmup_guard import BatchWarmupGuard
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.callbacks.guards.thermal_guard import ThermalGuard
from hf_stable.config.guards import GuardsConfig
from hf_stable.core.events import read_events
from hf_stable.errors import ConfigError
from tests.dist_scripts.guards_common import tiny_lora_llama, token_data, training_args


class StepGradientCheck(TrainerCallback):
    """Records each step's micro-batches (forward pre-hook) and, before the optimizer step, compares the
    accumulated gradient with the gradient of the token-mean loss over all of the step's micro-batches at once."""

    def __init__(self, model):
        self.model = model
        self.micro: list[dict] = []
        self.sizes: list[int] = []
        self.max_err: list[float] = []
        self.mean_of_means_gap: list[float] = []
        self.lrs: list[float] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled() and not getattr(self, "_busy", False):
            self.micro.append({"input_ids": kwargs["input_ids"].clone(), "labels": kwargs["labels"].clone()})

    def on_step_begin(self, args, state, control, **kwargs):
        self.micro = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        params = [p for p in self.model.parameters() if p.requires_grad]
        got = [p.grad.detach().clone() for p in params]
        ids = torch.cat([m["input_ids"] for m in self.micro])
        labels = torch.cat([m["labels"] for m in self.micro])
        self._busy = True
        with torch.enable_grad():
            want = torch.autograd.grad(self.model(input_ids=ids, labels=labels).loss, params)  # token mean
            per_micro = [torch.autograd.grad(self.model(**m).loss, params) for m in self.micro]
        self._busy = False
        mean_of_means = [sum(g[i] for g in per_micro) / len(per_micro) for i in range(len(params))]
        scale = max(float(w.abs().max()) for w in want)
        self.max_err.append(max(float((a - b).abs().max()) for a, b in zip(got, want, strict=False)) / scale)
        self.mean_of_means_gap.append(
            max(float((a - b).abs().max()) for a, b in zip(mean_of_means, want, strict=False)) / scale
        )
        self.sizes.append(len(self.micro))
        self.lrs.append(optimizer.param_groups[0]["lr"])


def _train(tmp_path, guards, max_steps, target, rows=48, **kw):
    model = tiny_lora_llama()
    check = StepGradientCheck(model)
    cfg = GuardsConfig()
    cfg.batch_warmup.enabled = True
    args = training_args(
        tmp_path,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        **guard_training_overrides(cfg, {"gradient_accumulation_steps": target}),
        **kw,
    )
    Trainer(model=model, args=args, train_dataset=token_data(rows), callbacks=[*guards, check]).train()
    return check


def test_batch_warmup_doubles_accumulation_and_keeps_per_token_normalisation(tmp_path):
    lr = LRControl()
    acc = AccumulationControl(lr, target=4, lr_rule="sqrt")
    check = _train(tmp_path, [BatchWarmupGuard(acc, initial_accumulation=1, double_every=2), acc, lr], 8, 4)
    # doubling is due after steps 2 and 4; 4 waits one step because 6 micro-batches are not a multiple of 4
    # (the Trainer's "step now" test is (micro_index + 1) % accumulation == 0)
    assert check.sizes == [1, 1, 2, 2, 2, 4, 4, 4]
    assert max(check.max_err) < 1e-4, check.max_err  # exactly the token-mean gradient of the step's micro-batches
    # the test can tell: with different supervised-token counts per row, a mean of micro-batch means differs
    assert min(g for g, n in zip(check.mean_of_means_gap, check.sizes, strict=False) if n > 1) > 1e-3
    assert check.lrs == pytest.approx([1e-3 * (n / 4) ** 0.5 for n in check.sizes])  # sqrt LR compensation
    assert acc.history == [(1, 1), (3, 2), (6, 4)]


def test_thermal_guard_8_to_6_and_back_with_injected_temperature(tmp_path):
    temps = iter([60, 80, 80, 80, 65, 65, 65, 65, 65, 65, 65, 65])  # read every 2 steps
    lr = LRControl()
    acc = AccumulationControl(lr, target=8, lr_rule="linear")
    thermal = ThermalGuard(acc, hot_c=75, cool_c=70, check_every=2, temperature_fn=lambda: next(temps))
    check = _train(tmp_path, [thermal, acc, lr], 12, 8, rows=192)
    # hot from the read after step 4; 8 -> 6 applies where the micro-batches consumed (32, 40, 48) are a multiple
    # of 6: from step 7. Cool at the read after step 10 (72 consumed, a multiple of 8): back to 8 from step 11.
    assert check.sizes == [8] * 6 + [6] * 4 + [8] * 2
    assert max(check.max_err) < 1e-4
    assert check.lrs == pytest.approx([1e-3 * n / 8 for n in check.sizes])  # linear rule: LR x 6/8 while hot
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds.count("thermal_throttle") == 1 and kinds.count("thermal_restore") == 1


def test_thermal_guard_is_a_no_op_without_nvml(tmp_path):
    cfg = GuardsConfig()
    cfg.thermal.enabled = True
    guards = build_guards(cfg, {"gradient_accumulation_steps": 2})
    check = _train(tmp_path, guards, 3, 2)
    assert check.sizes == [2, 2, 2]
    assert "thermal guard is a no-op" in next(e["message"] for e in read_events(tmp_path) if e["kind"] == "guard_off")


def test_accumulation_needs_max_steps(tmp_path):
    lr = LRControl()
    acc = AccumulationControl(lr, target=2)
    model = tiny_lora_llama()
    args = training_args(tmp_path, max_steps=-1, num_train_epochs=1)
    trainer = Trainer(model=model, args=args, train_dataset=token_data(8), callbacks=[acc, lr])
    with pytest.raises(ConfigError, match="training.max_steps"):
        trainer.train()


def test_accumulation_refuses_a_start_value_and_data_too_short_for_the_plan(tmp_path):
    lr = LRControl()
    acc = AccumulationControl(lr, target=4)
    model = tiny_lora_llama()
    args = training_args(tmp_path, max_steps=10, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match="must be 1"):
        Trainer(model=model, args=args, train_dataset=token_data(48), callbacks=[acc, lr]).train()
    args = training_args(tmp_path, max_steps=10, per_device_train_batch_size=2)  # needs 40 micro-batches, has 24
    with pytest.raises(ConfigError, match="need 40 micro-batches per rank, but the Trainer plans 1 epoch"):
        Trainer(model=model, args=args, train_dataset=token_data(48), callbacks=[acc, lr]).train()


def test_accumulation_lr_factor_is_optim_rescale_lr_and_refuses_an_unknown_rule(tmp_path):
    from hf_stable.optim import rescale_lr

    for rule in ("sqrt", "linear", "none"):
        lr = LRControl()
        acc = AccumulationControl(lr, target=4, lr_rule=rule)
        acc.request("test", 0.5)
        model = tiny_lora_llama()
        args = training_args(tmp_path / rule, max_steps=1, per_device_train_batch_size=2)
        Trainer(model=model, args=args, train_dataset=token_data(16), callbacks=[acc, lr]).train()
        want = 1.0 if rule == "none" else rescale_lr(1.0, 4, 2, rule)
        assert acc.current == 2 and lr.factor("accumulation") == pytest.approx(want), rule
    # one rule table (optim.rescale_lr): a misspelt rule is an error, not a silent sqrt
    lr = LRControl()
    acc = AccumulationControl(lr, target=4, lr_rule="linaer")
    args = training_args(tmp_path / "bad", max_steps=1, per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match="rule: got 'linaer'"):
        Trainer(model=tiny_lora_llama(), args=args, train_dataset=token_data(16), callbacks=[acc, lr]).train()
