"""One training sample shown as the model sees it, with its supervised span marked (audit and model card).

The text is decoded from the sample's token ids (not re-rendered from the record), so it shows what is trained:
the template's special tokens written out, the prompt, then the supervised span between ``⟦`` and ``⟧``.
"""

from __future__ import annotations

OPEN, CLOSE = "⟦", "⟧"
_MAX_PROMPT_CHARS = 1500


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def sample_view(tokenizer, first: dict | None) -> dict | None:
    """``{"where", "prompt", "supervised", "marked"}`` for `EncodeStats.first` (None when nothing was kept).

    A prompt longer than 1500 characters is shown with its middle elided in ``marked`` (``prompt`` stays whole).
    """
    if not first:
        return None
    prompt, supervised = _decode(tokenizer, first["prompt_ids"]), _decode(tokenizer, first["answer_ids"])
    shown = prompt
    if len(shown) > _MAX_PROMPT_CHARS:
        half = _MAX_PROMPT_CHARS // 2
        shown = f"{shown[:half]}…({len(prompt) - 2 * half} characters)…{shown[-half:]}"
    return {
        "where": first["where"],
        "prompt": prompt,
        "supervised": supervised,
        "marked": f"{shown}{OPEN}{supervised}{CLOSE}",
    }


def sample_markdown(view: dict | None) -> str:
    """A Markdown block with the marked sample (empty when there is none)."""
    if not view:
        return ""
    fence = "````"
    while fence in view["marked"]:
        fence += "`"
    return (
        f"A training sample as the model sees it (`{view['where']}`), the supervised span between {OPEN} and "
        f"{CLOSE}:\n\n{fence}text\n{view['marked']}\n{fence}"
    )
