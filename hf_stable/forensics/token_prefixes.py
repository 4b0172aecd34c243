"""Which vocabulary tokens spell the start of another: the table behind the trajectory rule's tokenization-robust NLL.

A model can be right about an answer's text and still be charged many nats for it, because the tokenizer's split
of the answer is not the one the model predicts: ``2400`` tokenized ``24|00`` where the model's next token is
``2``, the reversed word ``果苹果苹`` tokenized ``果|苹果|苹`` where the model predicts ``苹``. Scoring a language model
on one tokenization understates what it assigns to the text (Cao & Rimell 2021, arXiv 2109.02550, "You should
evaluate your language model on marginal likelihood over tokenisations"). The full marginal needs extra forward
passes; the first step of it needs none: at every answer position, the probability that the next token is the gold
token *or a token whose text is a strict prefix of it* - the mass of next tokens that agree with the answer's text.
On the embedded default it takes the clean records that fill a loss rule's tail (digit and Chinese-word splits)
out of it; see benchmarks/README.md, "forensics".

`prefix_table(tokenizer)` builds, once per run, ``[V, K]`` token ids (-1 padded): for each token, up to K of the
tokens whose text is a strict prefix of its text, longest first. Special and added tokens have none and are no
one's prefix; `text_mask` marks them, so the rule scores the answer's text and not where it stops (a model unsure
when a hard answer ends - a reversal one letter longer - is not evidence that the answer is another question's).
Pure in the tokenizer's vocabulary: every rank builds the same table.
"""

from __future__ import annotations

import torch


def prefix_table(tokenizer, max_prefixes: int = 8) -> torch.Tensor | None:
    """``[V, max_prefixes]`` long tensor (see the module docstring); None without a usable vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab: dict[str, int] = dict(get_vocab())
    except (TypeError, ValueError, NotImplementedError, AttributeError):  # a processor without a text vocabulary
        return None
    if not vocab:
        return None
    special = set(special_ids(tokenizer).tolist())
    text = {s: i for s, i in vocab.items() if i not in special and s}
    size = max(vocab.values()) + 1
    table = torch.full((size, max_prefixes), -1, dtype=torch.long)
    for s, i in text.items():
        found = [text[s[:n]] for n in range(len(s) - 1, 0, -1) if s[:n] in text][:max_prefixes]
        if found:
            table[i, : len(found)] = torch.tensor(found, dtype=torch.long)
    return table


def special_ids(tokenizer) -> torch.Tensor | None:
    """The tokenizer's special and added token ids (EOS, end of turn, padding), long; None without a tokenizer."""
    if tokenizer is None:
        return None
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    ids |= {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}
    return torch.tensor(sorted(ids), dtype=torch.long)


def text_mask(special: torch.Tensor | None, vocab_size: int, device) -> torch.Tensor | None:
    """``[vocab_size]`` bool on `device`: True for the tokens that are answer text (not in `special`)."""
    if special is None:
        return None
    mask = torch.ones(vocab_size, dtype=torch.bool)
    mask[special[special < vocab_size]] = False
    return mask.to(device)


def fit_to_vocab(table: torch.Tensor | None, vocab_size: int, device) -> torch.Tensor | None:
    """The table with exactly `vocab_size` rows (a model's logits may be padded past the tokenizer's vocabulary:
    those rows get no prefixes; ids past it are dropped), on `device`."""
    if table is None:
        return None
    if table.shape[0] < vocab_size:
        table = torch.cat([table, torch.full((vocab_size - table.shape[0], table.shape[1]), -1, dtype=table.dtype)])
    table = table[:vocab_size]
    table = torch.where(table < vocab_size, table, torch.full_like(table, -1))
    return table.to(device)
