"""Role assignment and report groups on real tiny Llama / Qwen2 / Qwen3, plain and PEFT-wrapped."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_stable.optim import classify, group_parameters, num_decoder_layers, param_groups
from tests.helpers import make_tiny_model

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Per decoder layer of the tiny models: (weight matrices, biases, norms). Qwen2 has q/k/v biases, Qwen3 q/k norms.
PER_LAYER = {"llama": (7, 0, 2), "qwen2": (7, 3, 2), "qwen3": (7, 0, 4)}
TIED = {"llama": False, "qwen2": True, "qwen3": True}


def _check_partition(model, groups):
    """Every trainable tensor in exactly one group; nothing else."""
    flat = [p for members in groups.values() for _, p in members]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}  # parameters() de-duplicates tied weights
    assert len(flat) == len({id(p) for p in flat}), "a tensor is in two groups"
    assert {id(p) for p in flat} == trainable


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_plain_model_groups_and_roles(arch, tokenizer):
    model = make_tiny_model(arch, tokenizer)
    groups = group_parameters(model)
    mats, biases, norms = PER_LAYER[arch]

    expected = {"embeddings": 1, "layer_0": mats + biases + norms, "layer_1": mats + biases + norms, "norm": 1}
    if not TIED[arch]:
        expected["lm_head"] = 1
    assert {g: len(m) for g, m in groups.items()} == expected
    assert list(groups) == list(expected)  # model order
    _check_partition(model, groups)

    roles = [classify(n).role for n, _ in groups["layer_1"]]
    assert (roles.count("layer"), roles.count("bias"), roles.count("norm")) == (mats, biases, norms)
    assert all(classify(n).layer == 1 for n, _ in groups["layer_1"])
    assert classify("model.norm.weight").role == "norm" and classify("model.norm.weight").layer is None
    assert num_decoder_layers(model) == 2

    # The tied lm_head is one tensor with the embedding: counted once, under the embedding.
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == TIED[arch]
    n_unique = len({id(p) for p in model.parameters()})
    assert sum(len(m) for m in group_parameters(model, trainable_only=False).values()) == n_unique


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_peft_lora_groups(arch, tokenizer):
    base = make_tiny_model(arch, tokenizer, num_hidden_layers=3)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=ALL_LINEAR))
    groups = group_parameters(model)

    expected = {f"layer_{i}.lora_{s}": 7 for i in range(3) for s in "AB"}
    assert {g: len(m) for g, m in groups.items()} == expected
    _check_partition(model, groups)
    assert num_decoder_layers(model) == 3
    for name, p in groups["layer_2.lora_B"]:
        role = classify(name)
        assert (role.role, role.site, role.layer, role.lora_side) == ("lora_B", "layer", 2, "B")
        assert name.startswith("base_model.model.model.layers.2.") and p.shape[1] == 4  # B is (out, r)

    # Frozen base weights keep their plain roles under the PEFT prefix and base_layer wrapper.
    frozen = group_parameters(model, trainable_only=False)
    assert len(frozen["embeddings"]) == 1
    base_q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert classify(base_q).group == "layer_0" and classify(base_q).role == "layer"
    if arch == "qwen2":
        assert classify("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias").role == "bias"


def test_peft_embedding_dora_and_modules_to_save(tokenizer):
    """LoRA on the embedding, DoRA magnitudes and a trainable lm_head copy on a tied Qwen2."""
    model = get_peft_model(
        make_tiny_model("qwen2", tokenizer),
        LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], use_dora=True, modules_to_save=["lm_head"]),
    )
    groups = group_parameters(model)
    assert {g: len(m) for g, m in groups.items()} == {
        "embeddings.lora_A": 1,
        "embeddings.lora_B": 1,
        "embeddings.dora_magnitude": 1,
        "layer_0.lora_A": 1,
        "layer_0.lora_B": 1,
        "layer_0.dora_magnitude": 1,
        "layer_1.lora_A": 1,
        "layer_1.lora_B": 1,
        "layer_1.dora_magnitude": 1,
        "lm_head": 1,
    }
    _check_partition(model, groups)
    [(name, _)] = groups["embeddings.lora_B"]
    assert classify(name).role == "lora_embedding" and classify(name).lora_side == "B"
    [(name, _)] = groups["layer_1.dora_magnitude"]
    assert classify(name).role == "dora_magnitude" and classify(name).lora_side is None

    # The optimizer groups cover the same tensors, each once.
    opt_groups = param_groups(model, lr=1e-3)
    flat = [id(p) for g in opt_groups for p in g["params"]]
    assert sorted(flat) == sorted(id(p) for m in groups.values() for _, p in m)


def test_unmatched_parameters_go_to_other_and_are_kept(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    model.register_parameter("temperature", torch.nn.Parameter(torch.ones(1)))
    groups = group_parameters(model)
    assert [n for n, _ in groups["other"]] == ["temperature"]
    opt_groups = param_groups(model, lr=1e-3)
    assert "temperature" in next(g for g in opt_groups if g["name"] == "other")["param_names"]
    _check_partition(model, groups)
