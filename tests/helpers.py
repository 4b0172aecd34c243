"""Helpers shared by several test modules: tiny real architectures, and the doctor's tiny recipe on disk.

Imported as `from tests.helpers import ...`; session fixtures built on them live in `tests/conftest.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_stable.config import EmbeddedBaseConfig
from tests.dist_scripts.harness import tiny_base_args

ROOT = Path(__file__).resolve().parents[1]
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


# --- the doctor's tests: the default recipe on a tiny base and a slice of the embedded data -----------------------


def tiny_args(tmp: Path, arch: str = "llama", *extra: str) -> list[str]:
    """The default recipe on a seconds-to-build tiny base (no pretraining) and 64 training records."""
    return [
        "--model.name_or_path",
        f"embedded:tiny-{arch}",
        *tiny_base_args(tmp / "bases"),
        "--data.train_file",
        str(tmp / "data" / "train.jsonl"),
        "--data.eval_file",
        str(tmp / "data" / "eval.jsonl"),
        "--training.per_device_train_batch_size",
        "8",
        "--training.output_dir",
        str(tmp / "out"),
        *extra,
    ]


def make_workdir(tmp: Path) -> Path:
    """`tmp/data/{train,eval}.jsonl`: the first 64 / 8 records of the embedded dataset."""
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    for name, n in (("train", 64), ("eval", 8)):
        lines = (ROOT / f"data/embedded/{name}.jsonl").read_text(encoding="utf-8").split("\n")[:n]
        (tmp / "data" / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp


def strict_json(text: str) -> dict:
    """`json.loads` that refuses NaN / Infinity (a report must be standard JSON)."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def by_check(report, check: str):
    """The findings of `report` from check `check`."""
    return [f for f in report.findings if f.check == check]
