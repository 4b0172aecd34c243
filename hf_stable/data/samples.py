"""Training samples: token ids + labels, the labels policy and the truncation policy.

What is prompt and what is answer is decided in ``prompts.py`` (the chat template's rendering, or the alpaca
layout + EOS); this module joins them. "End token" below is the token that ends the supervised span: the template's
end of turn (``<|eot_id|>``, ``<|im_end|>``), or the EOS without a template.

Labels policy:
    * prompt tokens get -100 (the model is not trained to write the question);
    * answer tokens and the end token are supervised — the end token *by position* (it is the last token
      of the sample), never by token id, so it is learned even when ``pad_token == eos_token``;
    * padding gets -100 in the collator (again by position: only the positions it adds).

Truncation policy (``data.max_length`` counts prompt + answer + end token):
    * the prompt is never cut: a model trained on a question missing its start learns answers to
      questions nobody asked;
    * if the sample is too long, the *answer* is cut from the right and the end token is kept as the last
      token, so every kept sample still teaches where an answer ends (counted as ``truncated`` in the
      audit — a high count means ``max_length`` is too small, because a cut answer followed by its end
      token teaches stopping early);
    * a sample whose prompt alone fills ``max_length`` has no room for a supervised token and is
      dropped and counted as ``no_supervised_token`` (an all -100 batch makes the loss NaN).

Token ids ≥ the vocabulary size (``len(tokenizer)``, or the model's embedding rows when the recipe
passes ``vocab_size``) are an error naming the sample: they index past the embedding matrix.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field

from hf_stable.data.prompts import encode_renderings, render_all
from hf_stable.data.records import Record
from hf_stable.errors import DataError

IGNORE_INDEX = -100

_TOKENIZER_LOGGER = "transformers.tokenization_utils_base"
_TOO_LONG = "Token indices sequence length is longer than"


class _TooLongNotice(logging.Filter):
    """Drops transformers' "Token indices sequence length is longer than ... will result in indexing errors" and
    nothing else: every record tokenized here is then cut or dropped by the truncation policy above, never fed
    whole to the model, so the warning would be false (and the audit counts those records)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TOO_LONG)


@contextlib.contextmanager
def _quiet_length_warning(tokenizer, max_length: int):
    """`_TooLongNotice` while encoding, when no kept sample can exceed the tokenizer's own limit (data.max_length
    <= model_max_length); a max_length beyond it leaves the warning on, since it is then true of kept samples."""
    limit = getattr(tokenizer, "model_max_length", None)
    if not isinstance(limit, int) or max_length > limit:
        yield
        return
    log, quiet = logging.getLogger(_TOKENIZER_LOGGER), _TooLongNotice()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


@dataclass
class EncodeStats:
    """What encoding did: kept / truncated counts and drops by reason (with the first few lines).

    Attributes:
        end_tokens: kept samples by the token that ends their supervised span (``{"<|im_end|>": 120}``).
        thinking: kept samples of a thinking template by rendering (``{"off": n, "on": m}``, see ``prompts.py``).
        first: the first kept sample's ``{"where", "prompt_ids", "answer_ids"}`` (the audit shows it rendered).
        n_aligned / n_reasoning_dropped: kept samples whose renderings were aligned / whose reasoning block the
            template leaves out (``Rendering.aligned`` / ``reasoning_dropped``).
    """

    n_in: int = 0
    n_kept: int = 0
    n_truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    dropped_examples: list[str] = field(default_factory=list)
    end_tokens: Counter = field(default_factory=Counter)
    thinking: Counter = field(default_factory=Counter)
    first: dict | None = None
    n_aligned: int = 0
    n_reasoning_dropped: int = 0


def build_sample(prompt_ids: list[int], answer_ids: list[int], max_length: int) -> tuple[list, list, bool] | None:
    """Join prompt and answer (which ends with its end token) under the truncation policy above.

    Returns:
        ``(input_ids, labels, truncated)``, or None when no supervised token fits.
    """
    n_prompt = len(prompt_ids)
    if n_prompt >= max_length or not answer_ids:
        return None
    truncated = n_prompt + len(answer_ids) > max_length
    if truncated:
        room = max_length - n_prompt  # >= 1: the end token always fits
        answer_ids = answer_ids[: room - 1] + answer_ids[-1:]
    return prompt_ids + answer_ids, [IGNORE_INDEX] * n_prompt + list(answer_ids), truncated


def check_vocab(input_ids: list[int], vocab_size: int, where: str) -> None:
    """Raise if any id is outside ``[0, vocab_size)``.

    Raises:
        DataError: naming the sample (``file:line``) and the offending id.
    """
    hi, lo = max(input_ids), min(input_ids)
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise DataError(
            f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size}); the tokenizer and the model "
            "disagree (added tokens without model.resize_token_embeddings, or a tokenizer from another model)"
        )


def encode_records(
    tokenizer,
    records: list[Record],
    *,
    max_length: int,
    template: str = "auto",
    vocab_size: int | None = None,
    chunk: int = 1024,
) -> tuple[list[dict], EncodeStats]:
    """Tokenize records into ``{"input_ids", "labels", "line", "record_id"}`` samples (``record_id``: the record's
    index in `records`, i.e. in the run's `RecordTable`).

    Args:
        tokenizer: a (fast) tokenizer with an EOS token.
        records: good records from `read_records`.
        max_length: tokens per sample, prompt + answer + end token.
        template: ``data.template``.
        vocab_size: ids must be below this; default ``len(tokenizer)``.
        chunk: records tokenized per fast-tokenizer call.

    Raises:
        DataError: a token id outside the vocabulary, or a conversation the chat template cannot render under the
            rule of ``prompts.py`` (naming file:line); a tokenizer without EOS.
    """
    vocab = int(vocab_size if vocab_size is not None else len(tokenizer))
    stats = EncodeStats(n_in=len(records))
    samples: list[dict] = []
    for start in range(0, len(records), chunk):
        part = records[start : start + chunk]
        with _quiet_length_warning(tokenizer, max_length):
            renderings = render_all(tokenizer, [r.data for r in part], template, [r.where for r in part])
            encoded = encode_renderings(tokenizer, renderings, template)
        for k, (rec, rendering, (p, a)) in enumerate(zip(part, renderings, encoded, strict=True)):
            built = build_sample(p, a, max_length)
            if built is None:
                stats.dropped["no_supervised_token"] += 1
                if len(stats.dropped_examples) < 20:
                    stats.dropped_examples.append(
                        f"{rec.where}: prompt is {len(p)} tokens, no room for the answer within max_length "
                        f"{max_length}"
                    )
                continue
            ids, labels, truncated = built
            check_vocab(ids, vocab, rec.where)
            stats.n_truncated += truncated
            stats.end_tokens[rendering.end_token] += 1
            if rendering.thinking is not None:
                stats.thinking["on" if rendering.thinking else "off"] += 1
            stats.n_aligned += rendering.aligned
            stats.n_reasoning_dropped += rendering.reasoning_dropped
            if stats.first is None:
                n = len(p)
                stats.first = {"where": rec.where, "prompt_ids": ids[:n], "answer_ids": ids[n:]}
            samples.append({"input_ids": ids, "labels": labels, "line": rec.line, "record_id": start + k})
    stats.n_kept = len(samples)
    return samples, stats
