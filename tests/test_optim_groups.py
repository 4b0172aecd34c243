"""LR ladder, weight decay, LoRA+, config errors, fp16 eps guard, group table and LR rescaling."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments

from hf_stable.config import OptimConfig, config_from_dict
from hf_stable.errors import ConfigError
from hf_stable.optim import (
    build_optimizer,
    format_group_table,
    group_table,
    param_groups,
    rescale_lr,
    save_group_table,
)
from tests.helpers import make_tiny_model

LR = 3e-4


def _by_name(groups):
    return {g["name"]: g for g in groups}


def _args(tmp_path, **kw):
    return TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_layer_decay_ladder_and_weight_decay(tokenizer, tmp_path):
    L = 3
    model = make_tiny_model("qwen2", tokenizer, num_hidden_layers=L)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie: lm_head gets a group
    cfg = OptimConfig(llrd_decay=0.8, embedding_lr_multiplier=0.5, lm_head_lr_multiplier=2.0)
    g = _by_name(param_groups(model, cfg, _args(tmp_path, learning_rate=LR, weight_decay=0.05)))

    for i in range(L):
        assert g[f"layer_{i}"]["lr"] == pytest.approx(LR * 0.8 ** (L - 1 - i))
        assert g[f"layer_{i}.no_decay"]["lr"] == g[f"layer_{i}"]["lr"]
        assert g[f"layer_{i}"]["weight_decay"] == 0.05 and g[f"layer_{i}.no_decay"]["weight_decay"] == 0.0
        names = g[f"layer_{i}.no_decay"]["param_names"]
        assert len(names) == 5 and all(n.endswith(".bias") or "norm" in n for n in names)
    assert g["embeddings"]["lr"] == pytest.approx(LR * 0.8**L * 0.5)
    assert g["lm_head"]["lr"] == pytest.approx(LR * 2.0)
    assert g["norm"]["lr"] == pytest.approx(LR)
    assert (g["embeddings"]["weight_decay"], g["norm"]["weight_decay"], g["lm_head"]["weight_decay"]) == (0, 0, 0.05)
    # The Trainer logs group 0's LR as `learning_rate`: it must be the base LR.
    assert param_groups(model, cfg, lr=LR)[0]["lr"] == LR


def test_explicit_bottom_lr_is_geometric(tokenizer):
    L = 4
    model = make_tiny_model("llama", tokenizer, num_hidden_layers=L)
    g = _by_name(param_groups(model, OptimConfig(llrd_lr_bottom=1e-5), lr=LR))
    ladder = [g["embeddings"]["lr"]] + [g[f"layer_{i}"]["lr"] for i in range(L)]
    assert ladder[0] == pytest.approx(1e-5) and ladder[-1] == pytest.approx(LR)
    ratios = [b / a for a, b in itertools.pairwise(ladder)]
    assert ratios == pytest.approx([(LR / 1e-5) ** (1 / L)] * L)


def test_lora_plus_composes_with_depth_decay(tokenizer):
    model = get_peft_model(
        make_tiny_model("llama", tokenizer, num_hidden_layers=3), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    cfg = OptimConfig(llrd_decay=0.5, lora_plus_ratio=8.0, lora_weight_decay=0.0)
    g = _by_name(param_groups(model, cfg, lr=1e-3, weight_decay=0.1))
    assert sorted(g) == sorted(f"layer_{i}.lora_{s}" for i in range(3) for s in "AB")
    for i in range(3):
        assert g[f"layer_{i}.lora_A"]["lr"] == pytest.approx(1e-3 * 0.5 ** (2 - i))
        assert g[f"layer_{i}.lora_B"]["lr"] == pytest.approx(8.0 * g[f"layer_{i}.lora_A"]["lr"])
    assert {x["weight_decay"] for x in g.values()} == {0.0}
    g = _by_name(param_groups(model, OptimConfig(), lr=1e-3, weight_decay=0.1))  # default: training.weight_decay
    assert {x["weight_decay"] for x in g.values()} == {0.1}
    assert g["layer_2.lora_B"]["lr"] == pytest.approx(16 * 1e-3)  # default ratio


@pytest.mark.parametrize(
    "optim, key",
    [
        ({"llrd_decay": 0.0}, "optim.llrd_decay"),
        ({"llrd_decay": 1.5}, "optim.llrd_decay"),
        ({"lora_plus_ratio": 0.0}, "optim.lora_plus_ratio"),
        ({"lora_plus_ratio": -2.0}, "optim.lora_plus_ratio"),
        ({"name": "adam"}, "optim.name"),
        ({"llrd_lr_bottom": -1e-5}, "optim.llrd_lr_bottom"),
    ],
)
def test_bad_optim_config_is_a_config_error(optim, key):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"optim": optim})
    assert any(p.startswith(key) for p in err.value.problems), err.value.problems


def test_build_optimizer_rejects_bad_values(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    with pytest.raises(ConfigError) as err:
        build_optimizer(model, OptimConfig(), _args(tmp_path, learning_rate=0.0))
    assert err.value.problems == ["training.learning_rate: got 0.0, must be > 0"]
    with pytest.raises(ConfigError) as err:  # every problem at once, named by its key
        build_optimizer(model, OptimConfig(llrd_decay=2.0, lora_plus_ratio=0.0), lr=-1.0)
    assert any(p.startswith("lr: got -1.0") for p in err.value.problems)
    with pytest.raises(ConfigError) as err:
        build_optimizer(model, OptimConfig(llrd_decay=2.0, lora_plus_ratio=0.0), lr=1e-3)
    assert sorted(p.split(":")[0] for p in err.value.problems) == ["optim.llrd_decay", "optim.lora_plus_ratio"]
    with pytest.raises(ConfigError, match="optim.llrd_lr_bottom: got 0.01, must be <= training.learning_rate"):
        build_optimizer(model, OptimConfig(llrd_lr_bottom=1e-2), _args(tmp_path, learning_rate=1e-3))


def test_optimizer_kinds_take_hyperparameters_from_training_args(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    args = _args(tmp_path, learning_rate=2e-4, weight_decay=0.03, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7)
    opt = build_optimizer(model, OptimConfig(name="adamw"), args)
    assert isinstance(opt, torch.optim.AdamW)
    assert (opt.defaults["betas"], opt.defaults["eps"], opt.defaults["lr"]) == ((0.8, 0.95), 1e-7, 2e-4)
    assert max(g["weight_decay"] for g in opt.param_groups) == 0.03
    sgd = build_optimizer(model, OptimConfig(name="sgd", sgd_momentum=0.8), args)
    assert isinstance(sgd, torch.optim.SGD) and (sgd.defaults["momentum"], sgd.defaults["nesterov"]) == (0.8, True)
    lion = build_optimizer(model, OptimConfig(name="lion", lion_betas=[0.95, 0.98]), args)
    assert type(lion).__name__ == "Lion" and lion.defaults["betas"] == (0.95, 0.98)
    fused = build_optimizer(model, OptimConfig(adamw_impl="fused"), args)
    assert fused.defaults["fused"] is True
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    before = model.lm_head.weight.detach().clone()
    fused.step()
    assert not torch.equal(before, model.lm_head.weight)


@pytest.mark.parametrize(
    "guard, expected_eps, warns", [("clamp", 1e-6, True), ("warn", 1e-8, True), ("off", 1e-8, False)]
)
def test_fp16_eps_guard(tokenizer, tmp_path, guard, expected_eps, warns):
    model = make_tiny_model("llama", tokenizer)
    args = _args(tmp_path, learning_rate=1e-4, adam_epsilon=1e-8, fp16=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = build_optimizer(model, OptimConfig(fp16_eps_guard=guard), args)
    assert opt.defaults["eps"] == expected_eps
    assert any("adam_epsilon" in str(w.message) for w in caught) == warns
    # Not fp16, or eps already large enough: untouched.
    assert build_optimizer(model, OptimConfig(), lr=1e-4, eps=1e-8).defaults["eps"] == 1e-8
    assert build_optimizer(model, OptimConfig(), lr=1e-4, eps=1e-5, fp16=True).defaults["eps"] == 1e-5


def test_fp16_eps_guard_error_and_half_weights(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    with pytest.raises(ConfigError, match="training.adam_epsilon: got 1e-08"):
        build_optimizer(model, OptimConfig(fp16_eps_guard="error"), lr=1e-4, eps=1e-8, fp16=True)
    with pytest.warns(UserWarning, match="fp16_eps_min"):  # pure fp16 weights trigger the guard without the flag
        assert build_optimizer(model.half(), OptimConfig(), lr=1e-4).defaults["eps"] == 1e-6


def test_group_table_rows_text_and_json(tokenizer, tmp_path):
    model = get_peft_model(make_tiny_model("llama", tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    opt = build_optimizer(model, OptimConfig(llrd_decay=0.5), lr=1e-3, weight_decay=0.01)
    rows = group_table(opt)
    assert [r["name"] for r in rows] == [g["name"] for g in opt.param_groups]
    assert sum(r["parameters"] for r in rows) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert {r["name"]: r["lr"] for r in rows}["layer_0.lora_B"] == pytest.approx(16 * 0.5e-3)
    text = format_group_table(rows)
    assert text.splitlines()[0].startswith("optimizer: torch.optim.AdamW")  # the class that runs, then the table
    lines = text.splitlines()[1:]
    assert lines[0].split() == ["name", "tensors", "parameters", "lr", "weight_decay"]
    assert "layer_0.lora_B" in text and lines[-1].startswith("total (4 groups)")
    assert len({len(line) for line in lines if not line.startswith("total")}) <= 2  # aligned columns
    saved = save_group_table(opt, tmp_path / "sub" / "optimizer_groups.json")
    assert json.loads((tmp_path / "sub" / "optimizer_groups.json").read_text()) == saved == rows


def test_rescale_lr():
    assert rescale_lr(1e-4, 8, 32, "sqrt") == pytest.approx(2e-4)
    assert rescale_lr(1e-4, 8, 32, "linear") == pytest.approx(4e-4)
    assert rescale_lr(6e-4, 8, 6, "linear") == pytest.approx(4.5e-4)
    assert rescale_lr(1e-4, 16, 4) == pytest.approx(1e-4 * math.sqrt(0.25))
    with pytest.raises(ConfigError):
        rescale_lr(1e-4, 0, 4)
    with pytest.raises(ConfigError, match="rule"):
        rescale_lr(1e-4, 2, 4, "cubic")
