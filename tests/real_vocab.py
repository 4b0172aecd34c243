"""Real Llama-3 and Qwen2 tokenizers and real chat templates, offline after one download per machine.

The llama-cpp-python sdist on the package index ships llama.cpp's vocab-only GGUF files with reference
tokenizations beside them (``.inp`` / ``.out``) and the chat templates of many checkpoints (``templates/``). The
first use on a machine runs ``pip download`` for it and keeps the few files we need in `CACHE`
(``~/.cache/hf_stable/llama_cpp_vocab``, or ``$HF_STABLE_VOCAB_CACHE``); a machine that cannot reach the package
index skips these tests, saying why.

Each tokenizer is configured as its checkpoint's Hub ``tokenizer_config.json`` is (`CASES`): Llama-3.1-Instruct
eos ``<|eot_id|>`` and no pad; Llama-3.1 base eos ``<|end_of_text|>``, no pad, no template; Qwen2.5 / Qwen3 Instruct
eos ``<|im_end|>``, pad ``<|endoftext|>``; Qwen2.5 base eos and pad ``<|endoftext|>`` with the same template as the
Instruct model. Qwen3 uses the Qwen2 vocabulary (the same BPE) plus the four tokens Qwen3 adds (``<think>``,
``</think>``, ``<tool_response>``, ``</tool_response>``, not special); their ids differ from the Hub's because the
GGUF pads the vocabulary to 151,936 first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.36"
MODELS = "vendor/llama.cpp/models/"
VOCABS = {"llama3": "ggml-vocab-llama-bpe.gguf", "qwen2": "ggml-vocab-qwen2.gguf"}
TEMPLATES = {
    "llama3.1": "templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
    "qwen2.5": "templates/Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3": "templates/Qwen-Qwen3-0.6B.jinja",
    # generation prompts that open the reply with <think> while assistant turns are rendered without it
    "qwq": "templates/Qwen-QwQ-32B.jinja",
    "r1-distill-qwen": "templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
}
FILES = [*(f"{v}{ext}" for v in VOCABS.values() for ext in ("", ".inp", ".out")), *TEMPLATES.values()]
SEPARATOR = "\n__ggml_vocab_test__\n"


def cache_dir() -> Path:
    return Path(os.environ.get("HF_STABLE_VOCAB_CACHE", "~/.cache/hf_stable/llama_cpp_vocab")).expanduser()


def fetch(timeout: int = 900) -> Path:
    """The cache dir holding `FILES`, downloading the sdist once. Raises RuntimeError saying why it could not."""
    cache = cache_dir()
    if all((cache / f).is_file() for f in FILES):
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", tmp],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            raise RuntimeError(f"pip download {PACKAGE} failed: {(proc.stderr or proc.stdout)[-500:]}")
        staged = Path(tmp) / "vocab"
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                rel = member.name.split("/", 1)[-1]
                if rel.startswith(MODELS) and rel[len(MODELS) :] in FILES and member.isfile():
                    target = staged / rel[len(MODELS) :]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        missing = [f for f in FILES if not (staged / f).is_file()]
        if missing:
            raise RuntimeError(f"{sdists[0].name} lacks {missing}")
        if not all((cache / f).is_file() for f in FILES):  # another session may have finished first
            shutil.rmtree(cache, ignore_errors=True)
            os.replace(staged, cache)
    return cache


def load_vocab(cache: Path, name: str) -> Path:
    """One GGUF vocabulary converted to a tokenizer dir (``AutoTokenizer.from_pretrained(cache, gguf_file=...)``,
    ~10-15 s), kept beside the GGUF files per transformers / tokenizers version so later sessions load it in
    well under a second."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    out = cache / f"converted-{transformers.__version__}-{tokenizers.__version__}" / name
    if not (out / "tokenizer.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            staged = Path(tmp) / name
            AutoTokenizer.from_pretrained(cache, gguf_file=VOCABS[name]).save_pretrained(staged)
            if not (out / "tokenizer.json").is_file():  # another session may have finished first
                shutil.rmtree(out, ignore_errors=True)
                os.replace(staged, out)
    return out


def reference_cases(cache: Path, name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's reference tokenizations of one vocabulary: (text, ids) pairs."""
    vocab = VOCABS[name]
    texts = (cache / f"{vocab}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = (cache / f"{vocab}.out").read_text(encoding="utf-8").split("\n")
    # both files end with their separator: the last piece of each is empty (the third case is the empty string)
    return [(t, [int(x) for x in i.split()]) for t, i in zip(texts[:-1], ids[:-1], strict=True)]


@dataclass(frozen=True)
class Case:
    """How one checkpoint's Hub tokenizer_config.json sets up its tokenizer."""

    name: str
    vocab: str
    template: str | None
    eos: str
    pad: str | None
    turn_end: str  # what the template ends an assistant turn with (the EOS when there is no template)
    bos: str | None = None
    extra_tokens: tuple[str, ...] = ()
    extra_special: tuple[str, ...] = ()


CASES = {
    c.name: c
    for c in (
        Case("llama3.1-instruct", "llama3", "llama3.1", "<|eot_id|>", None, "<|eot_id|>", "<|begin_of_text|>"),
        Case("llama3.1-base", "llama3", None, "<|end_of_text|>", None, "<|end_of_text|>", "<|begin_of_text|>"),
        Case("qwen2.5-instruct", "qwen2", "qwen2.5", "<|im_end|>", "<|endoftext|>", "<|im_end|>"),
        Case("qwen2.5-base", "qwen2", "qwen2.5", "<|endoftext|>", "<|endoftext|>", "<|im_end|>"),
        Case(
            "qwen3",
            "qwen2",
            "qwen3",
            "<|im_end|>",
            "<|endoftext|>",
            "<|im_end|>",
            extra_tokens=("<tool_response>", "</tool_response>", "<think>", "</think>"),
        ),
    )
}


# Templates whose generation prompt opens the reply with <think> while assistant turns are rendered without it
# (llama.cpp's copies, which also know enable_thinking): the renderings are aligned (see hf_stable/data/prompts.py).
_THINK = ("<think>", "</think>")
_R1 = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
ALIGNED_CASES = {
    c.name: c
    for c in (
        Case("qwq", "qwen2", "qwq", "<|im_end|>", "<|endoftext|>", "<|im_end|>", extra_tokens=_THINK),
        Case(
            "r1-distill-qwen",
            "qwen2",
            "r1-distill-qwen",
            _R1[1],
            _R1[1],
            _R1[1],
            bos=_R1[0],
            extra_tokens=_THINK,
            extra_special=_R1,
        ),
    )
}


def make_tokenizer(case: Case, base, cache: Path):
    """A copy of `base` (the vocabulary loaded with `AutoTokenizer`, as a user loads one) configured like `case`."""
    import copy

    tok = copy.deepcopy(base)
    if case.extra_tokens:
        tok.add_tokens(list(case.extra_tokens))
    if case.extra_special:
        tok.add_special_tokens({"additional_special_tokens": list(case.extra_special)})
    tok.chat_template = (cache / TEMPLATES[case.template]).read_text(encoding="utf-8") if case.template else None
    tok.eos_token = case.eos
    tok.pad_token = case.pad
    tok.bos_token = case.bos
    return tok


class RealTokenizers:
    """Loads each vocabulary and builds each case's tokenizer once (the `real_tokenizer` fixture)."""

    def __init__(self, cache: Path):
        self.cache = cache
        self._bases: dict[str, object] = {}
        self._toks: dict[str, object] = {}

    def base(self, vocab: str):
        """The vocabulary as converted from GGUF (its own eos / pad / template, as the GGUF sets them)."""
        from transformers import AutoTokenizer

        if vocab not in self._bases:
            self._bases[vocab] = AutoTokenizer.from_pretrained(load_vocab(self.cache, vocab))
        return self._bases[vocab]

    def __call__(self, name: str):
        if name not in self._toks:
            case = CASES.get(name) or ALIGNED_CASES[name]
            self._toks[name] = make_tokenizer(case, self.base(case.vocab), self.cache)
        return self._toks[name]
