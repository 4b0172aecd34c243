"""Prompts and answers: the one place that decides what the model sees and what it must produce.

The rule, with a chat template (``data.template: auto`` when the tokenizer has one, or ``chat_template``):

* the training sequence is the template's own rendering of the whole conversation
  (``apply_chat_template(messages, tokenize=False)``), which is what a chat server renders at inference;
* the prompt is what generation is given: the conversation before the final assistant turn rendered with
  ``add_generation_prompt=True``;
* the supervised span is the rest: the final assistant turn as the template writes it, through the turn's end
  token (``<|eot_id|>``, ``<|im_end|>``, the embedded template's EOS), whatever ``tokenizer.eos_token`` says. Only
  whitespace the template writes after that token (Qwen's ``\\n``) is left out. Nothing is appended that the
  template does not write, so a Qwen2.5 *base* tokenizer (eos ``<|endoftext|>``) learns to end turns with
  ``<|im_end|>``, as its template does.

Thinking templates (Qwen3, whose template knows ``enable_thinking``): rendered plainly, the generation prompt
ends at ``<|im_start|>assistant\\n`` while the final turn is written as ``<think>\\n\\n</think>\\n\\n42<|im_end|>``.
For an answer without a reasoning block we use the template's own switch, ``enable_thinking=False``, for both
renderings: the prompt then ends with the empty think block (exactly what generation with thinking off is given)
and the span is ``42<|im_end|>``. An answer that carries its reasoning (``...</think>...``) is rendered with
thinking on: the prompt ends at ``assistant\\n`` and the span is the think block, the answer and the end token.
The audit says which rendering each record got (``chat_rendering``, ``thinking``).

Templates whose generation prompt is not a prefix of their rendering in another way (QwQ, DeepSeek-R1: the
generation prompt opens ``<think>\\n``, assistant turns are rendered without their think block) are aligned: the
supervised span is what the template writes in the final turn after its header, placed after the generation prompt
(the model is trained on what it will be given and must then write); the audit counts them (``n_aligned``) and
alerts when such a template leaves a reasoning block of the data out (``n_reasoning_dropped``). Any other mismatch
is an error naming the record.

Without a template (``alpaca``, e.g. a base Llama): a ``### Instruction / ### Input / ### Response`` layout after
the tokenizer's BOS, and the answer followed by exactly one EOS (``tokenizer.eos_token_id``).

The answer text is the final assistant message (chat) or ``output`` (alpaca), stripped of surrounding whitespace
(``"42\\n"`` and ``"42"`` teach the same ending); an end-of-turn or EOS text it already ends with is removed,
since the template (or the alpaca layout) writes the end once. Multi-turn chat: only the final assistant turn is
supervised; earlier turns are prompt.

Prompt and span are tokenized separately (``add_special_tokens=False``; the template owns BOS), so no token
crosses the boundary and the prompt a model is evaluated on is token for token the prompt it was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_stable.data.cleaning import clean_text
from hf_stable.errors import DataError

TEMPLATES = ("auto", "chat_template", "alpaca")
_PROBE = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


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
    """The text the model must produce (no end token), stripped."""
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


def is_thinking_template(tokenizer) -> bool:
    """The chat template has a thinking switch (``enable_thinking``, as Qwen3's does)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "enable_thinking" in template


def _has_reasoning(answer: str) -> bool:
    return "</think>" in answer  # how Qwen3's template itself tells a reasoning block in the content


@dataclass(frozen=True)
class Rendering:
    """One record as the model sees it.

    Attributes:
        prompt: what generation is given (text, special tokens written out); the alpaca BOS is not in it.
        answer: the supervised span as text: the final turn through its end token (alpaca: without the EOS,
            which is appended as an id).
        end_token: the token that ends the supervised span (the template's end of turn, or the EOS).
        thinking: the ``enable_thinking`` value both renderings used, or None (no thinking switch; alpaca).
        aligned: the generation prompt was not a prefix of the conversation's rendering: the final turn's text
            (after its header) follows the generation prompt instead (see `_final_turn_start`).
        reasoning_dropped: the answer has a reasoning block that the template's rendering leaves out.
    """

    prompt: str
    answer: str
    end_token: str
    thinking: bool | None = None
    aligned: bool = False
    reasoning_dropped: bool = False


def _special_texts(tokenizer) -> list[str]:
    """Texts of the tokenizer's special tokens, longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            texts.add(str(tok.content))
    return sorted((t for t in texts if t), key=len, reverse=True)


def _strip_endings(answer: str, endings: list[str]) -> str:
    changed = True
    while changed:
        changed = False
        for end in endings:
            if end and answer.endswith(end):
                answer, changed = answer[: -len(end)].rstrip(), True
    return answer


_SENTINEL = "\ue000"  # a private-use character: no template writes it, so it marks where the answer's text goes


def _final_turn_start(tokenizer, before: list[dict], prompt: str, full: str, kwargs: dict) -> tuple[int, bool]:
    """Where the supervised span starts in `full`, and whether the renderings had to be aligned.

    The generation prompt is normally a prefix of the conversation's rendering. Some templates open the reply
    with something the final turn does not hold (QwQ and DeepSeek-R1 write ``<think>\n`` into the generation
    prompt but drop the think block from assistant turns): then the final turn's header is found by rendering a
    sentinel answer, and what the template writes after the header is placed after the generation prompt, which
    is what the model will be given.
    """
    if full.startswith(prompt):
        return len(prompt), False
    probe = tokenizer.apply_chat_template(
        [*before, {"role": "assistant", "content": _SENTINEL}], tokenize=False, **kwargs
    )
    history = tokenizer.apply_chat_template(before, tokenize=False, **kwargs)
    header = probe[: probe.find(_SENTINEL)] if _SENTINEL in probe else ""
    if not (header and full.startswith(header) and header.startswith(history) and prompt.startswith(header)):
        raise DataError(
            "the chat template's generation prompt (add_generation_prompt=True) does not match how its rendering "
            f"of the conversation opens the final turn: prompt ends {prompt[-60:]!r}, the conversation has "
            f"{full[len(history) : len(history) + 60]!r}; fix the template or use data.template: alpaca"
        )
    return len(header), True


def _render_chat(tokenizer, record: dict, specials: list[str]) -> Rendering:
    answer = answer_text(record) if _has_answer(record) else None
    kwargs = {}
    if is_thinking_template(tokenizer):
        kwargs["enable_thinking"] = bool(answer and _has_reasoning(answer))
    before = prompt_messages(record)
    prompt = tokenizer.apply_chat_template(before, add_generation_prompt=True, tokenize=False, **kwargs)
    if answer is None:  # a prompt only (e.g. the empty question of the forensics screening)
        return Rendering(prompt, "", "", kwargs.get("enable_thinking"))
    eos = getattr(tokenizer, "eos_token", None) or ""
    for _ in range(4):  # re-rendered only when the answer itself ends with the end text
        full = tokenizer.apply_chat_template(
            [*before, {"role": "assistant", "content": answer}], tokenize=False, **kwargs
        )
        start, aligned = _final_turn_start(tokenizer, before, prompt, full, kwargs)
        span = full[start:].rstrip()
        end = next((t for t in specials if span.endswith(t)), None)
        if end is None:
            raise DataError(
                f"the chat template ends the final assistant turn with {span[-40:]!r}, not with a special token, so "
                "generation could never be told where to stop; use a template that ends turns with a special token "
                "(as <|eot_id|> / <|im_end|>) or data.template: alpaca"
            )
        trimmed = _strip_endings(answer, [end, eos])
        if trimmed == answer:
            break
        answer = trimmed
    dropped = _has_reasoning(answer) and "</think>" not in span
    return Rendering(prompt, span, end, kwargs.get("enable_thinking"), aligned, dropped)


def _has_answer(record: dict) -> bool:
    return "messages" in record or "output" in record


def render(tokenizer, record: dict, template: str = "auto", *, specials: list[str] | None = None) -> Rendering:
    """The prompt and supervised span of `record` under the rule above.

    Raises:
        DataError: the tokenizer has no EOS (alpaca), or the chat template cannot follow the rule.

    Example:
        >>> r = render(qwen_tok, {"messages": [{"role": "user", "content": "6 x 7?"},
        ...                                    {"role": "assistant", "content": "42"}]})
        >>> r.prompt[-22:], r.answer, r.end_token
        ('<|im_start|>assistant\\n', '42<|im_end|>', '<|im_end|>')
    """
    if resolve_template(tokenizer, template) == "chat_template":
        return _render_chat(tokenizer, record, _special_texts(tokenizer) if specials is None else specials)
    eos = tokenizer.convert_ids_to_tokens(eos_id(tokenizer))
    answer = _strip_endings(answer_text(record), [eos]) if _has_answer(record) else ""
    return Rendering(_alpaca_text(record), answer, eos, None)


def prompt_text(tokenizer, record: dict, template: str = "auto") -> str:
    """The prompt as text (special tokens written out), ending where the answer starts."""
    return render(tokenizer, record, template).prompt


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


def render_all(tokenizer, records: list[dict], template: str = "auto", where: list[str] | None = None):
    """`render` for each record; an error names the record (``where[i]``, e.g. ``train.jsonl:12``)."""
    resolved = resolve_template(tokenizer, template)
    specials = _special_texts(tokenizer) if resolved == "chat_template" else None
    out = []
    for i, rec in enumerate(records):
        try:
            out.append(render(tokenizer, rec, resolved, specials=specials))
        except DataError as e:
            raise DataError(f"{where[i] if where else f'record {i}'}: {e}") from None
    return out


def encode_renderings(tokenizer, renderings: list[Rendering], template: str) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, answer ids)`` per rendering; the answer ids end with the span's end token."""
    if not renderings:
        return []
    resolved = resolve_template(tokenizer, template)
    prefix = _bos_prefix(tokenizer, resolved)
    prompts = tokenizer([r.prompt for r in renderings], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r.answer for r in renderings], add_special_tokens=False)["input_ids"]
    out = []
    for r, p, a in zip(renderings, prompts, answers, strict=True):
        a = list(a)
        if resolved == "alpaca":
            a.append(eos_id(tokenizer))
        elif r.end_token and (not a or a[-1] != tokenizer.convert_tokens_to_ids(r.end_token)):
            raise DataError(
                f"the answer span {r.answer[-40:]!r} does not tokenize to end with {r.end_token!r} as one token "
                "(does the tokenizer split special tokens? set tokenizer.split_special_tokens = False)"
            )
        out.append((prefix + list(p), a))
    return out


def encode_prompts(tokenizer, records: list[dict], template: str = "auto") -> list[list[int]]:
    """Batched `encode_prompt` (one fast-tokenizer call for all records)."""
    resolved = resolve_template(tokenizer, template)
    return [p for p, _ in encode_renderings(tokenizer, render_all(tokenizer, records, resolved), resolved)]


def encode_prompt(tokenizer, record: dict, template: str = "auto") -> list[int]:
    """Prompt token ids ending with the generation prompt: what the model sees before it must answer.

    Built exactly as for training, so ``model.generate(torch.tensor([encode_prompt(tok, r)]))`` asks
    the trained question (stop it at `stop_token_ids`). Pass records from ``DataBundle.eval_records``: they were
    cleaned exactly as the training records were (no cleaning happens here, so ``data.clean: false`` stays
    consistent).

    Example:
        >>> ids = encode_prompt(tok, {"instruction": "What is 3 + 4?", "input": "", "output": "7"})
        >>> tok.decode(ids)
        '<|begin_of_text|><|user|>\\nWhat is 3 + 4?\\n<|assistant|>\\n'
    """
    return encode_prompts(tokenizer, [record], template)[0]


def stop_token_ids(tokenizer, template: str = "auto", end_tokens=()) -> list[int]:
    """Token ids that end an answer: the template's end-of-turn token(s), then the tokenizer's EOS.

    `end_tokens`: end tokens seen in the data (``EncodeStats.end_tokens``), listed first; without them a probe
    conversation finds the template's end of turn. Alpaca: the EOS alone.
    """
    if hasattr(end_tokens, "items"):  # a count per end token: the most frequent first
        end_tokens = [t for t, _ in sorted(end_tokens.items(), key=lambda kv: -kv[1])]
    names = [t for t in end_tokens if t]
    if not names and resolve_template(tokenizer, template) == "chat_template":
        names = [render(tokenizer, _PROBE, "chat_template").end_token]
    ids = [int(tokenizer.convert_tokens_to_ids(t)) for t in names] + [eos_id(tokenizer)]
    return list(dict.fromkeys(ids))


def describe_rendering(tokenizer, template: str, thinking: dict | None = None, n_aligned: int = 0) -> str:
    """One sentence for the audit: how records became prompt + supervised span."""
    if template != "chat_template":
        after = " after BOS" if getattr(tokenizer, "bos_token_id", None) is not None else ""
        return (
            f"no chat template: alpaca layout (### Instruction / ### Input / ### Response){after}, answer + "
            f"EOS {tokenizer.eos_token}"
        )
    text = "the tokenizer's chat template renders each conversation; supervised: the final assistant turn as written"
    if is_thinking_template(tokenizer):
        off, on = (thinking or {}).get("off", 0), (thinking or {}).get("on", 0)
        text += (
            f"; thinking template: {off} answers without a reasoning block rendered with enable_thinking=False "
            f"(the prompt ends with the empty think block), {on} with their reasoning rendered with thinking on"
        )
    if n_aligned:
        text += (
            f"; {n_aligned} aligned: the generation prompt opens the reply differently from the rendered turn, so "
            "the turn's text after its header follows the generation prompt"
        )
    return text
