"""QLoRA: a 4-bit NF4 base (bitsandbytes on CPU) with LoRA on top and 8-bit optimizers, under every guard.

A tiny Llama is saved once and loaded quantized per test (milliseconds). The fault tests assert outcomes on the
8-bit optimizer state itself (uint8 moments, qmap, absmax): a skipped step leaves it bitwise as it was, a
rollback restores it exactly, a resume continues bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("bitsandbytes")

from hf_stable.callbacks.guards import ClipGuard, LRControl, RollbackGuard, SkipGuard, build_guards
from hf_stable.callbacks.monitors import NonFiniteLocator
from hf_stable.config import load_config
from hf_stable.config.guards import GuardsConfig
from hf_stable.config.optim import OptimConfig
from hf_stable.core.events import read_events
from hf_stable.errors import ConfigError
from hf_stable.optim import build_optimizer, format_group_table, group_table
from hf_stable.trainer import StableTrainer
from tests.dist_scripts.guards_common import (
    GradFaultOnRank,
    WeightDamage,
    all_finite,
    token_data,
    training_args,
    weights_equal,
)
from tests.qlora_helpers import quantized_lora_llama, save_tiny_llama

OPTIM = OptimConfig(name="adamw_8bit", bnb_min_8bit_size=1024)  # the tiny LoRA factors reach 1024 elements


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("qbase"))


def _state(optimizer) -> dict:
    """The live optimizer state by parameter index (bitsandbytes' state_dict packs it differently)."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return {index[id(p)]: copy.deepcopy(dict(s)) for p, s in optimizer.state.items() if s}


def _states_equal(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    for i, entry in a.items():
        if set(entry) != set(b[i]):
            return False
        for key, value in entry.items():
            other = b[i][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                return False
    return True


def _recorder(model):
    from transformers import TrainerCallback

    class Rec(TrainerCallback):
        def __init__(self):
            self.weights, self.state = {}, {}

        def _take(self, step, optimizer):
            self.weights[step] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            self.state[step] = _state(optimizer)

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            self._take(state.global_step, optimizer)

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            self._take(state.global_step, optimizer)

    return Rec()


def _train(base_dir, out, callbacks_for, *, optim=OPTIM, resume=None, first=(), damage=(), **args_kw):
    """Train the quantized tiny LoRA Llama with `callbacks_for(model)`; `first` run before them, `damage`: steps
    after whose update every LoRA B turns NaN (what an overflowing update does), until a rollback."""
    model = quantized_lora_llama(base_dir)
    args = training_args(out, **args_kw)
    optimizer = build_optimizer(model, optim, args)
    rec = _recorder(model)
    guards = callbacks_for(model)
    trainer = StableTrainer(
        model=model,
        args=args,
        train_dataset=token_data(),
        optimizers=(optimizer, None),
        callbacks=[*first, *guards, rec, *([WeightDamage(model, damage)] if damage else [])],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, rec, guards, model


def _eight_bit_keys(state: dict) -> set:
    return {k for entry in state.values() for k, v in entry.items() if getattr(v, "dtype", None) == torch.uint8}


# --- loading and config ---------------------------------------------------------------------------------------------


def test_quantized_base_is_4bit_frozen_with_fp32_lora(base_dir):
    import bitsandbytes as bnb

    model = quantized_lora_llama(base_dir)
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    assert layer.self_attn.q_proj.base_layer.weight.quant_state.quant_type == "nf4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    # prepare_model_for_kbit_training left no 16-bit weight: the unquantized ones are fp32
    assert {p.dtype for p in model.parameters() if p.dtype.is_floating_point} == {torch.float32}
    assert not isinstance(model.base_model.model.lm_head, bnb.nn.Linear4bit)  # the head is never quantized


def test_config_refuses_what_cannot_work(monkeypatch):
    quant = ["--model.quantization.load_in", "4bit"]
    with pytest.raises(ConfigError) as e:
        load_config(argv=[*quant, "--lora.enabled", "false"])
    assert "lora.enabled" in str(e.value) and "quantized weights have no gradients" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(argv=[*quant, "--attention.qk_clip", "true"])
    assert "attention.qk_clip" in str(e.value) and "q_proj/k_proj are quantized" in str(e.value)
    # keeping q/k unquantized makes QK-clip possible again
    load_config(argv=[*quant, "--attention.qk_clip", "true", "--model.quantization.skip_modules", "[q_proj, k_proj]"])
    with pytest.raises(ConfigError) as e:
        load_config(argv=["--model.quantization.load_in", "8bit", "--model.quantization.quant_type", "fp4"])
    assert "model.quantization.quant_type" in str(e.value)

    import hf_stable.import_utils as iu

    real = iu._has
    monkeypatch.setattr(iu, "_has", lambda m: False if m == "bitsandbytes" else real(m))
    for argv in (quant, ["--optim.name", "paged_adamw_8bit"]):
        with pytest.raises(ConfigError) as e:
            load_config(argv=argv)
        assert 'pip install "hf-stable[bitsandbytes]"' in str(e.value)


def test_tiny_qlora_recipe_loads():
    cfg = load_config("configs/tiny-qlora.yaml")
    assert cfg.model.quantization.load_in == "4bit" and cfg.optim.name == "paged_adamw_8bit"
    bnb_cfg = cfg.model.quantization.bnb_config()
    assert bnb_cfg.load_in_4bit and bnb_cfg.bnb_4bit_quant_type == "nf4" and bnb_cfg.bnb_4bit_use_double_quant


# --- the optimizer factory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit", "lion_8bit"])
def test_8bit_optimizers_keep_the_factory_groups(base_dir, tmp_path, name):
    model = quantized_lora_llama(base_dir)
    args = training_args(tmp_path, learning_rate=1e-3, weight_decay=0.01)
    ref = group_table(build_optimizer(model, OptimConfig(name="adamw"), args))
    opt = build_optimizer(model, OptimConfig(name=name), args)
    rows = group_table(opt)
    cls = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit", "lion_8bit": "Lion8bit"}[name]
    assert type(opt).__name__ == cls
    strip = [{k: v for k, v in r.items() if k != "optimizer"} for r in rows]
    assert strip == [{k: v for k, v in r.items() if k != "optimizer"} for r in ref]  # LLRD, no-decay, LoRA+
    lora_b = [r for r in rows if r["name"].endswith("lora_B")]
    assert lora_b and all(r["lr"] > 10 * rows[0]["lr"] for r in lora_b)  # LoRA+ ratio 16 survived
    assert rows[0]["optimizer"] == f"bitsandbytes.optim.{cls}"
    assert format_group_table(rows).splitlines()[0] == f"optimizer: bitsandbytes.optim.{cls}"


def test_fp16_eps_guard_applies_to_8bit_adamw(base_dir, tmp_path):
    model = quantized_lora_llama(base_dir)
    args = training_args(tmp_path, adam_epsilon=1e-8)
    with pytest.warns(UserWarning, match="fp16_eps_min"):
        opt = build_optimizer(model, OptimConfig(name="adamw_8bit"), args, fp16=True)
    assert opt.defaults["eps"] == 1e-6
    with pytest.raises(ConfigError, match="adam_epsilon"):
        build_optimizer(model, OptimConfig(name="paged_adamw_8bit", fp16_eps_guard="error"), args, fp16=True)


# --- guards over the quantized base -------------------------------------------------------------------------------


def test_nonfinite_lora_grad_is_named_and_skipped_bitwise_with_8bit_state(base_dir, tmp_path):
    bad = 5
    locator = NonFiniteLocator()
    _trainer, rec, _, model = _train(
        base_dir,
        tmp_path,
        lambda m: [locator, *build_guards(GuardsConfig())],
        first=[GradFaultOnRank(bad, rank=0)],  # NaN in the first LoRA gradient, before the guards look
        max_steps=8,
    )
    first_lora = next(n for n, p in model.named_parameters() if p.requires_grad)
    assert ".lora_A." in first_lora
    located = [e for e in read_events(tmp_path) if e["kind"] == "nonfinite_grad"]
    assert len(located) == 1 and located[0]["step"] == bad and located[0]["params"] == [first_lora]
    assert weights_equal(rec.weights[bad - 1], rec.weights[bad])
    assert _eight_bit_keys(rec.state[bad]) >= {"state1", "state2"}  # the state really is 8-bit
    assert _states_equal(rec.state[bad - 1], rec.state[bad])  # uint8 moments, qmap, absmax, step untouched
    assert not weights_equal(rec.weights[bad], rec.weights[bad + 1]) and all_finite(rec.weights[8])


def test_rollback_restores_the_8bit_state_exactly(base_dir, tmp_path):
    def guards_for(model):
        skip, lr = SkipGuard(), LRControl()
        rollback = RollbackGuard(skip, lr, snapshot_every=3, bad_steps=2, window=4)
        return [skip, rollback, ClipGuard(skip_guard=skip), lr]

    # good 1..7 (snapshots after 3 and 6), LoRA B damaged after step 7's update: steps 8 and 9 are bad, the second
    # bad step within 4 rolls back to step 6's snapshot
    _, rec, guards, _ = _train(base_dir, tmp_path, guards_for, max_steps=11, damage=[7])
    assert next(g for g in guards if isinstance(g, RollbackGuard)).rollbacks == 1
    assert weights_equal(rec.weights[9], rec.weights[6]) and not weights_equal(rec.weights[7], rec.weights[6])
    eight_bit = [e for e in rec.state[6].values() if getattr(e.get("state1"), "dtype", None) == torch.uint8]
    assert eight_bit and set(eight_bit[0]) >= {"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"}
    assert not _states_equal(rec.state[7], rec.state[6])
    assert _states_equal(rec.state[9], rec.state[6])  # uint8 moments, absmax, qmap and step as at step 6
    assert all_finite(rec.weights[11])


def test_resume_from_a_checkpoint_is_bitwise_with_8bit_state(base_dir, tmp_path):
    guards = lambda m: build_guards(GuardsConfig())
    full, rec_full, _, _ = _train(base_dir, tmp_path / "full", guards, max_steps=8)
    _train(base_dir, tmp_path / "cut", guards, max_steps=8, save_strategy="steps", save_steps=4)
    _, rec_resumed, _, _ = _train(
        base_dir, tmp_path / "cut", guards, max_steps=8, resume=str(tmp_path / "cut" / "checkpoint-4")
    )
    assert weights_equal(rec_full.weights[8], rec_resumed.weights[8])
    assert _eight_bit_keys(rec_full.state[8]) and _states_equal(rec_full.state[8], rec_resumed.state[8])
    assert full.state.global_step == 8


# --- attention, QK-clip, snapshot sizes -------------------------------------------------------------------------


def test_hf_stable_attention_equals_sdpa_on_the_quantized_model(base_dir):
    from hf_stable.attention import register
    from hf_stable.config import AttentionConfig

    register(AttentionConfig())
    ids = torch.tensor(token_data(n=4)[0]["input_ids"]).view(1, -1).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # one left-padded row
    out = {}
    for impl in ("sdpa", "hf_stable"):
        model = quantized_lora_llama(base_dir, attn_implementation=impl)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        out[impl] = (loss.detach(), grads)
    assert torch.equal(out["sdpa"][0], out["hf_stable"][0])
    assert all(torch.equal(g, out["hf_stable"][1][n]) for n, g in out["sdpa"][1].items())


def test_qk_clip_refuses_quantized_projections_by_name(base_dir):
    from hf_stable.attention.qk_clip import attention_layers, clip_layer, layer_mode

    model = quantized_lora_llama(base_dir)
    attn = attention_layers(model)[0]
    mode, reason = layer_mode(attn)
    assert mode == "refused" and "quantized" in reason and "sharded" not in reason
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert clip_layer(attn, [500.0] * 4, tau=100.0).action == "refused"
    assert weights_equal(before, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad})


def test_snapshot_size_predicts_the_8bit_state_before_the_first_step(base_dir, tmp_path):
    from hf_stable.core.snapshot_size import estimate_size, snapshot_size

    model = quantized_lora_llama(base_dir)
    opt = build_optimizer(model, OPTIM, training_args(tmp_path))
    predicted = snapshot_size(opt)
    assert not predicted.state_measured
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    opt.step()
    measured = snapshot_size(opt)
    assert measured.state_measured and predicted.state == measured.state
    assert measured.state < measured.params  # 8-bit moments: below the fp32 weights, where AdamW's are 2x them
    n = 10**6
    assert estimate_size(n, 4, "paged_adamw_8bit").state < 0.26 * estimate_size(n, 4, "adamw").state


def test_an_eval_forward_leaves_the_4bit_weights_as_loaded(base_dir):
    from hf_stable.compat import keep_cpu_4bit_layout

    model = quantized_lora_llama(base_dir)
    assert keep_cpu_4bit_layout(model) == 0  # already done by the loader: nothing left to change
    base = model.base_model.model.model.layers[0].mlp.down_proj.base_layer
    before = base.weight.detach().clone()
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert torch.equal(base.weight.detach(), before)
    assert not getattr(base.weight.quant_state, "packing_format_for_cpu", False)


@pytest.mark.parametrize("factor", [float("nan"), 60.0])
def test_forensics_name_the_poisoned_record_over_the_quantized_base(base_dir, tmp_path, monkeypatch, factor):
    import tests.dist_scripts.forensics_run as fr
    from hf_stable.forensics.quarantine import read_quarantine

    # the forensics tests' poisoned run (a record whose logits are scaled or NaN'd), on the 4-bit base
    monkeypatch.setattr(fr, "tiny_lora_llama", lambda: quantized_lora_llama(base_dir))
    idx = fr.position_of(6)
    trainer, skip, _ = fr.build(tmp_path, factor=factor, poison_index=idx, steps=8)
    assert "Linear4bit" in type(trainer.model.base_model.model.model.layers[0].mlp.up_proj.base_layer).__name__
    trainer.train()
    assert skip.skipped_steps == [6]
    (entry,) = read_quarantine(tmp_path)
    assert entry["where"] == f"train.jsonl:{idx + 1}" and entry["step"] == 6
    assert entry["reason"] == ("nonfinite_loss" if math.isnan(factor) else "loss_outlier")
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters() if p.is_floating_point())


def test_an_8bit_base_trains_its_adapter(base_dir, tmp_path):
    import bitsandbytes as bnb

    model = quantized_lora_llama(base_dir, load_in="8bit")
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear8bitLt)
    opt = build_optimizer(model, OPTIM, training_args(tmp_path))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.tensor([row["input_ids"].tolist() for row in token_data(n=4)])
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] and all(math.isfinite(v) for v in losses)
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert len(moved) == len(before)  # every LoRA factor, A and B, trained over the frozen int8 weights
