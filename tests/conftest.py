"""Shared fixtures: tiny real architectures and tokenizers built offline (no Hub access)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest
import torch

from hf_stable.config import EmbeddedBaseConfig
from hf_stable.embedded.tasks import instruction_dataset, pretraining_corpus
from hf_stable.embedded.tokenizer import train_tokenizer

ARCHS = ("llama", "qwen2", "qwen3")

# Small enough that a forward/backward is milliseconds on 2 cores.
TINY = EmbeddedBaseConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    pretrain_steps=0,
)


def _tok_corpus() -> list[str]:
    rows, _ = instruction_dataset(0, n_train=300, n_eval=0)
    return pretraining_corpus(0, n_lines=1500) + [r["instruction"] + " " + r["input"] for r in rows]


@pytest.fixture(scope="session")
def tokenizer():
    """Byte-level BPE with a distinct pad token and a chat template."""
    return train_tokenizer(_tok_corpus(), vocab_size=TINY.vocab_size)


@pytest.fixture(scope="session")
def tokenizer_pad_eos():
    """The same tokenizer but pad_token == eos_token (the Llama-3 habit)."""
    return train_tokenizer(_tok_corpus(), vocab_size=TINY.vocab_size, pad_equals_eos=True)


def make_tiny_model(arch: str, tokenizer, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A randomly initialised tiny `arch` model (llama / qwen2 / qwen3) sized by `TINY`."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from hf_stable.embedded.builder import tiny_model_config

    cfg = dataclasses.replace(TINY, **overrides) if overrides else TINY
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        tiny_model_config(arch, cfg, tokenizer), attn_implementation=attn_implementation
    )


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture
def tiny_model(arch, tokenizer):
    return make_tiny_model(arch, tokenizer)


@pytest.fixture(scope="session")
def base_cache(tmp_path_factory):
    """A per-session cache dir for embedded bases (never the user's ~/.cache)."""
    path = tmp_path_factory.mktemp("bases")
    os.environ["HF_STABLE_CACHE"] = str(path.parent / "hf_stable_cache")
    return path
