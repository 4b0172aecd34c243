"""The embedded tiny bases: deterministic builds, atomic cache, the generated dataset."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from hf_stable.config import EmbeddedBaseConfig
from hf_stable.embedded.builder import DONE_FILE, ensure_base
from hf_stable.embedded.tasks import instruction_dataset

SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 400,
    "pretrain_steps": 3,
    "pretrain_batch_size": 4,
    "pretrain_seq_len": 16,
}


def _weights_hash(path) -> str:
    tensors = load_file(str(path / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].to(torch.float32).numpy().tobytes())
    return h.hexdigest()


def test_same_seed_same_weights_different_seed_differs(tmp_path):
    a = ensure_base("llama", EmbeddedBaseConfig(**SMALL, cache_dir=str(tmp_path / "a")))
    b = ensure_base("llama", EmbeddedBaseConfig(**SMALL, cache_dir=str(tmp_path / "b")))
    c = ensure_base("llama", EmbeddedBaseConfig(**SMALL, seed=7, cache_dir=str(tmp_path / "c")))
    assert a.name == b.name  # same cache key
    assert _weights_hash(a) == _weights_hash(b)
    assert (a / "tokenizer" / "tokenizer.json").read_text() == (b / "tokenizer" / "tokenizer.json").read_text()
    assert _weights_hash(a) != _weights_hash(c)
    info = json.loads((a / DONE_FILE).read_text())
    assert info["pretrain_loss_last"] < info["pretrain_loss_first"]  # it really pretrained


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_bases_build_and_tie_embeddings(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = ensure_base(arch, EmbeddedBaseConfig(**SMALL, cache_dir=str(tmp_path)))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_partial_cache_entry_is_rebuilt(tmp_path):
    cfg = EmbeddedBaseConfig(**SMALL, cache_dir=str(tmp_path))
    path = ensure_base("llama", cfg)
    before = _weights_hash(path)
    (path / DONE_FILE).unlink()  # as if the build had been killed before finishing
    (path / "model.safetensors").write_bytes(b"garbage")
    again = ensure_base("llama", cfg)
    assert again == path and (again / DONE_FILE).is_file()
    assert _weights_hash(again) == before
    temps = [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.is_dir()]  # (the lock file stays)
    assert not temps, "temp build dirs left behind"


def test_concurrent_builders_share_one_build_and_a_long_wait_is_said(tmp_path, monkeypatch, capsys):
    """Two processes (here: threads, each with its own lock file handle) asking for the same missing base: one
    builds, the other waits for it and reads its build; a wait past WAIT_NOTICE_S is said on the waiter's stderr."""
    import threading

    from hf_stable.embedded import builder

    monkeypatch.setattr(builder, "WAIT_NOTICE_S", 0.05)
    monkeypatch.setenv("RANK", "1")  # as on a launch's second rank, which says its own waits (on its stderr)
    builds = []
    building, noticed = threading.Event(), threading.Event()
    real_build, real_say = builder.build_base, builder.say_on_this_rank

    def build(*a, **kw):  # the builder holds the lock until the waiter has said its wait (no race on a busy machine)
        builds.append(1)
        building.set()
        noticed.wait(timeout=60)
        return real_build(*a, **kw)

    def say(message):
        real_say(message)
        if message.startswith("waited "):
            noticed.set()

    monkeypatch.setattr(builder, "build_base", build)
    monkeypatch.setattr(builder, "say_on_this_rank", say)
    cfg = EmbeddedBaseConfig(**SMALL, cache_dir=str(tmp_path))
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(ensure_base("llama", cfg))) for _ in range(2)]
    threads[0].start()
    assert building.wait(timeout=120)  # the first holds the lock and builds; the second comes while it does
    threads[1].start()
    for t in threads:
        t.join(timeout=120)
    assert len(paths) == 2 and paths[0] == paths[1] and (paths[0] / DONE_FILE).is_file()
    assert builds == [1]  # built once
    err = capsys.readouterr().err
    assert err.count("building embedded base tiny-llama (seed") == 1
    assert "[hf_stable] rank 1: waited 0s for rank 1 (pid" in err and "to finish building embedded base tiny-l" in err


def test_dataset_is_deterministic_disjoint_and_dirty():
    train, held = instruction_dataset(0)
    train2, _ = instruction_dataset(0)
    assert train == train2 and len(train) == 2000 and len(held) == 200
    held_prompts = {(r["instruction"], r["input"]) for r in held}
    assert not held_prompts & {(r["instruction"], r["input"]) for r in train}
    text = "".join(r["instruction"] + r["input"] for r in train)
    assert any(ch in text for ch in "\u200b\ufeff\u200d\u2060"), "zero-width characters expected"
    assert any(ch in text for ch in "\x07\x1b\x00\x85"), "control characters expected"
    assert sum(not r["input"] for r in train) > 100
    assert 0 < sum(not r["output"].endswith("\n") for r in train) < len(train)
    assert {r["lang"] for r in train} == {"en", "zh"} and len({r["family"] for r in train}) == 4


def test_committed_dataset_matches_generator():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "data" / "embedded"
    train, held = instruction_dataset(0)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows == train
    rows = [json.loads(line) for line in (root / "eval.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows == held


def test_cache_key_changes_when_the_generated_corpus_changes(monkeypatch):
    from hf_stable.embedded import builder, tasks

    cfg = EmbeddedBaseConfig(**SMALL)
    before = builder.cache_key("llama", cfg)
    assert builder.cache_key("llama", cfg) == before
    original = tasks.pretraining_corpus
    monkeypatch.setattr(tasks, "pretraining_corpus", lambda seed, n_lines=6000: original(seed, n_lines)[:-1])
    assert builder.cache_key("llama", cfg) != before  # a stale base is rebuilt, never reused
