"""The doctor's memory estimate follows the training loss (`training_loss.chunked`), and the 7B / 8B recipes fit the
budgets their headers state at the sizes they ask for, with the numbers their headers quote.

The real architectures are built on the meta device from their published shapes (no download, no weights)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hf_stable.config import load_config
from hf_stable.doctor.memory_estimate import GIB, estimate_memory, memory_findings
from hf_stable.doctor.settings import resolve_settings

SHAPES = {  # hidden, MLP, layers, heads, KV heads, vocabulary; untied heads
    "llama": (LlamaConfig, 4096, 14336, 32, 32, 8, 128256),
    "qwen": (Qwen2Config, 3584, 18944, 28, 28, 4, 152064),
}
RECIPES = {  # recipe: (architecture, budget in GB its header states)
    "llama3.1-8b-lora": ("llama", 80),
    "llama3.1-8b-qlora": ("llama", 24),
    "qwen2.5-7b-lora": ("qwen", 80),
    "qwen2.5-7b-qlora": ("qwen", 24),
}


def _meta(arch: str):
    cls, hidden, inter, layers, heads, kv, vocab = SHAPES[arch]
    config = cls(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _estimate(recipe: str, *argv: str):
    cfg = load_config(f"configs/{recipe}.yaml", list(argv), check=False)
    s = resolve_settings(cfg, None, remove_unused_columns=False)
    model = _meta(RECIPES[recipe][0])
    return cfg, s, model, estimate_memory(model, cfg, s, meta=True)


def test_the_logits_term_is_one_chunk_when_chunked_and_every_token_otherwise():
    argv = ["--data.max_length", "4096", "--training.per_device_train_batch_size", "4"]
    _, _, _, full = _estimate("llama3.1-8b-qlora", *argv, "--training_loss.chunked", "false")
    _, _, _, chunked = _estimate("llama3.1-8b-qlora", *argv, "--training_loss.chunk_size", "2048")
    tokens, vocab, hidden = 4 * 4096, 128256, 4096  # bf16 compute: 2-byte logits, 4-byte upcast
    assert full.parts["logits"] == tokens * vocab * (2 + 12)  # logits, fp32 copy, log-softmax, gradient
    assert chunked.parts["logits"] == 2048 * vocab * (2 + 8) + tokens * (hidden * 2 + 24)
    assert full.parts["logits"] / chunked.parts["logits"] > 10
    assert {k: v for k, v in full.parts.items() if k != "logits"} == {
        k: v for k, v in chunked.parts.items() if k != "logits"
    }  # nothing else changes
    assert any("chunked loss, 2048 of 16384 tokens" in n for n in chunked.notes)
    assert not any("chunked" in n for n in full.notes)


def test_a_model_the_chunked_loss_does_not_fit_is_estimated_with_the_whole_logits():
    cfg, s, model, _ = _estimate("llama3.1-8b-qlora")
    model.config.logit_scale = 0.5  # its forward scales the logits: training keeps the model's forward
    tokens = s.micro_batch * cfg.data.max_length
    assert estimate_memory(model, cfg, s, meta=True).parts["logits"] == tokens * 128256 * 14


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_7b_8b_recipes_fit_their_budget_as_their_header_says(recipe):
    cfg, s, model, est = _estimate(recipe)
    budget = RECIPES[recipe][1]
    assert cfg.doctor_checks.memory_budget_gib == budget
    (finding,) = memory_findings(cfg, s, cfg.doctor_checks, meta_model=model)
    assert finding.severity == "info" and "fits" in finding.what
    assert est.total < 0.85 * budget * cfg.doctor_checks.memory_headroom * GIB  # a margin below the budget
    # the header quotes this estimate, and the whole-logits estimate of the recipe's previous sizes
    lines = Path(f"configs/{recipe}.yaml").read_text().splitlines()
    header = "\n".join(line for line in lines if line.startswith("#"))
    after, before = re.search(r"estimate, .*?\): ([\d.]+) GiB .*? was ([\d.]+) GiB", header, re.DOTALL).groups()
    assert float(after) == round(est.total / GIB, 2)
    mb, accum = (4, 4) if RECIPES[recipe][1] == 80 else (2, 8)
    old = ["--data.max_length", "2048", "--training.per_device_train_batch_size", str(mb)]
    old += ["--training.gradient_accumulation_steps", str(accum), "--training_loss.chunked", "false"]
    assert float(before) == round(_estimate(recipe, *old)[3].total / GIB, 2)
    # the same sizes with the whole logits would not fit
    _, _, _, full = _estimate(recipe, "--training_loss.chunked", "false")
    assert full.total > budget * cfg.doctor_checks.memory_headroom * GIB
    # sequences per update unchanged (16 packed rows), each row as long as data.max_length says
    assert s.micro_batch * cfg.training["gradient_accumulation_steps"] == 16 and cfg.data.max_length == 4096
