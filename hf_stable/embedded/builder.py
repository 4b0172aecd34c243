"""Build, briefly pretrain and cache the tiny embedded base checkpoints (Llama, Qwen2, Qwen3).

A base is a pure function of its config: same seed and sizes → bitwise the same weights. Builds are
cached under a key derived from the config and `BUILDER_VERSION`, written to a temp dir and renamed
into place, so an interrupted build is never picked up; a stale or partial entry is rebuilt. One process builds a
given entry at a time (a file lock next to it): the ranks of a launch, or runs started together, wait for the first
builder and then read its build, and a wait longer than `WAIT_NOTICE_S` says which rank waits for whom.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from hf_stable.config.model import EmbeddedBaseConfig
from hf_stable.logging import process_rank, say_on_this_rank

BUILDER_VERSION = 1
DONE_FILE = "build_info.json"
WAIT_NOTICE_S = 60.0  # a start-up wait on another process's build longer than this is said (on the waiting rank)


def tiny_model_config(arch: str, cfg: EmbeddedBaseConfig, tokenizer):
    """A transformers config of family `arch` sized by `cfg` (also used by tests for from-config models)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=True, head_dim=cfg.hidden_size // cfg.num_attention_heads)
    raise ValueError(f"unknown embedded arch {arch!r}")


def default_cache_dir() -> Path:
    root = os.environ.get("HF_STABLE_CACHE") or Path.home() / ".cache" / "hf_stable"
    return Path(root) / "bases"


def _training_texts(cfg: EmbeddedBaseConfig) -> tuple[list[str], list[str]]:
    """(pretraining corpus, tokenizer corpus): both are generated from the task templates."""
    from hf_stable.embedded.tasks import instruction_dataset, pretraining_corpus

    corpus = pretraining_corpus(cfg.seed)
    # The tokenizer also sees instruction phrasing so prompts tokenize sensibly; the model does not.
    train_rows, _ = instruction_dataset(cfg.seed, n_train=500, n_eval=0)
    return corpus, corpus + [r["instruction"] + " " + r["input"] for r in train_rows]


def cache_key(arch: str, cfg: EmbeddedBaseConfig) -> str:
    """Depends on the config, the builder version and the generated texts, so a changed generator rebuilds."""
    payload = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "cache_dir"}
    corpus, tok_texts = _training_texts(cfg)
    texts = hashlib.sha256("\n".join(corpus + tok_texts).encode()).hexdigest()
    payload.update(arch=arch, builder=BUILDER_VERSION, texts=texts)
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
    return f"tiny-{arch}-{digest}"


def _pretrain(model, tokenizer, cfg: EmbeddedBaseConfig, corpus: list[str]) -> list[float]:
    import torch

    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for line in corpus:
        stream.extend(tokenizer(line).input_ids + [eos])
    n = len(stream) // cfg.pretrain_seq_len
    data = torch.tensor(stream[: n * cfg.pretrain_seq_len]).view(n, cfg.pretrain_seq_len)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.01)
    warm = max(1, cfg.pretrain_steps // 10)

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.pretrain_steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    for _ in range(cfg.pretrain_steps):
        idx = torch.randint(0, n, (cfg.pretrain_batch_size,), generator=gen)
        batch = data[idx]
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def embedded_tokenizer(arch: str, cfg: EmbeddedBaseConfig):
    """The tokenizer of the embedded base (`arch`, `cfg`) without building the base: the cached base's own when it
    exists, else trained in memory from the same seeded corpus (`build_base` trains it first, from nothing else).
    For a data audit, which needs the tokenizer and not the pretrained weights."""
    from transformers import PreTrainedTokenizerFast

    from hf_stable.embedded.tokenizer import train_tokenizer

    entry = (Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()) / cache_key(arch, cfg)
    if _complete(entry):
        return PreTrainedTokenizerFast.from_pretrained(entry / "tokenizer")
    return train_tokenizer(_training_texts(cfg)[1], vocab_size=cfg.vocab_size)


def build_base(arch: str, cfg: EmbeddedBaseConfig, out_dir: str | Path) -> dict:
    """Build the tiny `arch` base into `out_dir` (model + `tokenizer/`). Returns build info."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_stable.embedded.tokenizer import train_tokenizer

    t0 = time.time()
    torch.manual_seed(cfg.seed)
    corpus, tok_texts = _training_texts(cfg)
    tokenizer = train_tokenizer(tok_texts, vocab_size=cfg.vocab_size)
    model_cfg = tiny_model_config(arch, cfg, tokenizer)
    model = AutoModelForCausalLM.from_config(model_cfg, attn_implementation="sdpa")
    threads = torch.get_num_threads()
    losses = _pretrain(model, tokenizer, cfg, corpus) if cfg.pretrain_steps else []
    torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir / "tokenizer")
    info = {
        "arch": arch,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "cache_dir"},
        "builder_version": BUILDER_VERSION,
        "pretrain_loss_first": losses[0] if losses else None,
        "pretrain_loss_last": losses[-1] if losses else None,
        "build_seconds": round(time.time() - t0, 2),
        "n_parameters": sum(p.numel() for p in model.parameters()),
    }
    (out_dir / DONE_FILE).write_text(json.dumps(info, indent=2))
    return info


@contextlib.contextmanager
def _build_lock(path: Path, what: str):
    """Hold an exclusive lock on `path` (a file next to the cache entry) while building `what`; another process
    holding it is waited for, and after `WAIT_NOTICE_S` this rank says, on its own stderr, whom it waits for. Where
    `fcntl` is missing (Windows) nothing is locked: builds may then run twice, the rename keeps one."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    me = f"rank {process_rank()} (pid {os.getpid()} on {socket.gethostname()})"
    with open(path, "a+", encoding="utf-8") as fh:
        waited_from, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said and time.monotonic() - waited_from >= WAIT_NOTICE_S:
                    fh.seek(0)
                    holder = fh.read().strip() or "another process"
                    say_on_this_rank(
                        f"waited {time.monotonic() - waited_from:.0f}s for {holder} to finish building "
                        f"{what} (lock file {path}; delete it only if that process is gone)"
                    )
                    said = True
                time.sleep(0.2)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(me)
            fh.flush()
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _complete(entry: Path) -> bool:
    return (entry / DONE_FILE).is_file() and (entry / "tokenizer").is_dir()


def ensure_base(arch: str, cfg: EmbeddedBaseConfig) -> Path:
    """Path of the cached tiny base for (`arch`, `cfg`), building it first if missing or stale (one process at a
    time: the others wait for its build, see `_build_lock`).

    Build it before a ZeRO-3 `TrainingArguments` exists: from then on every `from_config` is a collective
    (`deepspeed.zero.Init`) that a rank building alone would wait in forever (the recipe builds first).
    """
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    final = cache / cache_key(arch, cfg)
    if _complete(final):
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache / f".{final.name}.lock", f"embedded base tiny-{arch} into {final}"):
        if _complete(final):  # built by the process we waited for
            return final
        return _build_into(arch, cfg, cache, final)


def _build_into(arch: str, cfg: EmbeddedBaseConfig, cache: Path, final: Path) -> Path:
    if final.exists():  # partial or stale: never trust it
        shutil.rmtree(final, ignore_errors=True)
    # whichever rank builds, before the wait starts; the default size takes about a minute on a 2-core CPU
    estimate = ", ~1 min" if dataclasses.replace(cfg, cache_dir=None) == type(cfg)() else ""
    say_on_this_rank(f"building embedded base tiny-{arch} (seed {cfg.seed}){estimate}, once: cached at {final}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
    try:
        info = build_base(arch, cfg, tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race; its build is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    first, last = info["pretrain_loss_first"] or float("nan"), info["pretrain_loss_last"] or float("nan")
    say_on_this_rank(
        f"built tiny-{arch} in {info['build_seconds']:.1f}s: {info['n_parameters']} parameters, pretrain loss "
        f"{first:.3f} -> {last:.3f}"
    )
    return final
