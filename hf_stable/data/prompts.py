"""Prompts and answers: the one place that decides what the model sees and what it must produce.

Training and exact-match generation both call these functions, so the prompt a model is evaluated
on is token-for-token the prompt it was trained on (the prompt and the answer are tokenized
separately; tokenizing their concatenation could merge tokens across the boundary and silently
shift what is supervised).

Prompt: with the tokenizer's chat template (``template="auto"`` when it has one, or
``"chat_template"``), the messages before the final assistant answer are rendered with
``apply_chat_template(..., add_generation_prompt=True, tokenize=False)`` and tokenized with
``add_special_tokens=False`` (the template owns BOS). Without one (``"alpaca"``) a plain
``### Instruction / ### Input / ### Response`` layout is used, after the tokenizer's BOS if it has one.

Answer: the final assistant message (chat) or ``output`` (alpaca), stripped of surrounding whitespace
(so ``"42\\n"`` and ``"42"`` teach the same ending), tokenized, then exactly one EOS
(``tokenizer.eos_token_id``) at the end: an EOS the text itself already ends with is not doubled.
For Llama-3 style templates set ``eos_token`` to ``<|eot_id|>``, for Qwen style to ``<|im_end|>``.
Multi-turn chat: only the final assistant turn is supervised; earlier turns are prompt.
"""

from __future__ import annotations

from hf_stable.data.cleaning import clean_text
from hf_stable.errors import DataError

TEMPLATES = ("auto", "chat_template", "alpaca")


def resolve_template(tokenizer, template: str = "auto") -> str:
    """``"chat_template"`` or ``"alpaca"`` for this tokenizer and the configured ``data.template``.

    Raises:
        DataError: ``chat_template`` asked for but the tokenizer has none, or an unknown name.
    """
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template == "auto":
        return "chat_template" if has_chat else "alpaca"
    if template == "chat_template" and not has_chat:
        raise DataError("data.template: chat_template, but the tokenizer has no chat template; use auto or alpaca")
    if template not in TEMPLATES:
        raise DataError(f"data.template: got {template!r}, must be one of {', '.join(TEMPLATES)}")
    return template


def _user_text(record: dict) -> str:
    instruction = record["instruction"].strip()
    extra = (record.get("input") or "").strip()
    return f"{instruction}\n\n{extra}" if extra else instruction


def prompt_messages(record: dict) -> list[dict]:
    """The conversation before the answer: chat messages minus the last, or one user turn for alpaca."""
    if "messages" in record:
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"][:-1]]
    return [{"role": "user", "content": _user_text(record)}]


def answer_text(record: dict) -> str:
    """The text the model must produce (no EOS), stripped."""
    text = record["messages"][-1]["content"] if "messages" in record else record["output"]
    return text.strip()


def reference_answer(record: dict) -> str:
    """The expected answer for exact match: cleaned (see ``cleaning.py``) and stripped."""
    return clean_text(answer_text(record))[0].strip()


def _alpaca_text(record: dict) -> str:
    if "messages" in record:
        turns = "".join(f"### {m['role'].capitalize()}:\n{m['content'].strip()}\n\n" for m in prompt_messages(record))
        return f"{turns}### Assistant:\n"
    extra = (record.get("input") or "").strip()
    body = f"### Instruction:\n{record['instruction'].strip()}\n\n"
    if extra:
        body += f"### Input:\n{extra}\n\n"
    return body + "### Response:\n"


def prompt_text(tokenizer, record: dict, template: str = "auto") -> str:
    """The prompt as text (special tokens written out), ending where the answer starts."""
    if resolve_template(tokenizer, template) == "chat_template":
        return tokenizer.apply_chat_template(prompt_messages(record), add_generation_prompt=True, tokenize=False)
    return _alpaca_text(record)


def _bos_prefix(tokenizer, template: str) -> list[int]:
    # The chat template writes BOS itself; the alpaca layout has no place for it, so add it here.
    if template == "alpaca" and getattr(tokenizer, "bos_token_id", None) is not None:
        return [tokenizer.bos_token_id]
    return []


def eos_id(tokenizer) -> int:
    """The tokenizer's EOS id.

    Raises:
        DataError: when the tokenizer has no EOS token (a sample could never learn to stop).
    """
    eid = getattr(tokenizer, "eos_token_id", None)
    if eid is None:
        raise DataError("the tokenizer has no eos_token; set tokenizer.eos_token so every sample can end with EOS")
    return int(eid)


def encode_prompts(tokenizer, records: list[dict], template: str = "auto") -> list[list[int]]:
    """Batched `encode_prompt` (one fast-tokenizer call for all records)."""
    resolved = resolve_template(tokenizer, template)
    texts = [prompt_text(tokenizer, r, resolved) for r in records]
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    prefix = _bos_prefix(tokenizer, resolved)
    return [prefix + list(x) for x in ids]


def encode_answers(tokenizer, records: list[dict]) -> list[list[int]]:
    """Answer ids for each record, each ending with exactly one EOS."""
    eid = eos_id(tokenizer)
    texts = [answer_text(r) for r in records]
    if not texts:
        return []
    out = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids = list(ids)
        while ids and ids[-1] == eid:
            ids.pop()
        out.append(ids + [eid])
    return out


def encode_prompt(tokenizer, record: dict, template: str = "auto") -> list[int]:
    """Prompt token ids ending with the generation prompt: what the model sees before it must answer.

    Built exactly as for training, so ``model.generate(torch.tensor([encode_prompt(tok, r)]))`` asks
    the trained question. Pass records from ``DataBundle.eval_records``: they were cleaned exactly as
    the training records were (no cleaning happens here, so ``data.clean: false`` stays consistent).

    Example:
        >>> ids = encode_prompt(tok, {"instruction": "What is 3 + 4?", "input": "", "output": "7"})
        >>> tok.decode(ids)
        '<|begin_of_text|><|user|>\\nWhat is 3 + 4?\\n<|assistant|>\\n'
    """
    return encode_prompts(tokenizer, [record], template)[0]
