"""The trajectory rule's tokenization-robust NLL (issue 25): a right answer split by the tokenizer otherwise than the
model predicts it is not charged as a wrong one; an answer of another kind still is."""

from __future__ import annotations

import math

import pytest
import torch

from hf_stable.forensics.sample_loss import per_sample_answer_stats, per_sample_loss
from hf_stable.forensics.token_prefixes import fit_to_vocab, prefix_table


def _split(tokenizer, text: str) -> list[str]:
    return [tokenizer.convert_ids_to_tokens(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def test_prefix_table_lists_the_tokens_spelling_a_prefix_and_never_special_ones(tokenizer):
    table = prefix_table(tokenizer)
    vocab = tokenizer.get_vocab()
    assert table.shape[0] == max(vocab.values()) + 1
    checked, specials = 0, set(tokenizer.all_special_tokens)
    for text, i in vocab.items():
        if text in specials:
            continue
        listed = [tokenizer.convert_ids_to_tokens(int(j)) for j in table[i] if j >= 0]
        assert all(text.startswith(p) and p != text for p in listed), (text, listed)
        assert [len(p) for p in listed] == sorted((len(p) for p in listed), reverse=True)  # longest first
        expected = [text[:n] for n in range(len(text) - 1, 0, -1) if text[:n] in vocab][: table.shape[1]]
        assert listed == [p for p in expected if p not in specials]
        checked += bool(listed)
    assert checked > 100  # a BPE vocabulary: most merges have a shorter prefix token
    for sid in tokenizer.all_special_ids:
        assert (table[sid] < 0).all()
    assert (fit_to_vocab(table, table.shape[0] + 5, "cpu")[-5:] < 0).all()  # logits padded past the vocabulary


def test_a_right_answer_split_otherwise_costs_little_and_a_wrong_one_the_full_nll(tokenizer):
    """Logits that put 90 % of the next-token mass on a token that spells the start of the gold token (the model
    predicts ``2`` where the tokenizer wrote ``24``): plain NLL charges -ln(0.01) nats, the agreeing mass
    -ln(0.91); a gold token whose prefixes get no mass (an answer of another kind) costs the same under both."""
    table = prefix_table(tokenizer)
    vocab = tokenizer.get_vocab()
    gold, prefix = next((i, int(table[i, 0])) for t, i in sorted(vocab.items()) if table[i, 0] >= 0 and len(t) > 1)
    other = next(i for i in range(len(vocab)) if i not in (gold, prefix) and i not in set(table[gold].tolist()))
    v = table.shape[0]
    probs = torch.full((v,), 0.09 / (v - 2))
    probs[prefix], probs[gold] = 0.9, 0.01
    logits = torch.zeros(2, 3, v)
    logits[:, 1] = probs.log()
    labels = torch.tensor([[-100, -100, gold], [-100, -100, other]])
    loss, count, nats, first, margin = per_sample_answer_stats(logits, labels, prefixes=fit_to_vocab(table, v, "cpu"))
    plain, plain_count = per_sample_loss(logits, labels)
    assert torch.allclose(loss, plain, rtol=1e-5) and torch.equal(count, plain_count)  # screening's, same pass
    assert plain[0] == pytest.approx(-math.log(0.01), rel=1e-4)
    assert nats[0] == pytest.approx(-math.log(0.91), rel=1e-4) and first[0] == nats[0]  # one supervised token
    assert margin[0] > 0  # the agreeing mass beats every disagreeing token
    assert nats[1] == pytest.approx(float(plain[1]), rel=1e-5) and margin[1] < -5  # another kind: charged in full
    _, _, bare_nats, _, bare_margin = per_sample_answer_stats(logits, labels)  # no tokenizer: the plain NLL
    assert bare_nats[0] == pytest.approx(float(plain[0]), rel=1e-5) and bare_margin[0] < 0


def test_answer_stats_of_a_packed_batch_follow_its_segments(tokenizer):
    torch.manual_seed(0)
    v = len(tokenizer.get_vocab())
    logits = torch.randn(1, 8, v)
    labels = torch.tensor([[-100, 5, 6, 7, -100, 9, 10, -100]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])  # two samples and a tail padding segment
    loss, count, nats, first, margin = per_sample_answer_stats(
        logits, labels, pos, 3, fit_to_vocab(prefix_table(tokenizer), v, "cpu")
    )
    plain, plain_count = per_sample_loss(logits, labels, pos, 3)
    assert torch.allclose(loss[:2], plain[:2], rtol=1e-5) and torch.equal(count, plain_count)
    lp = logits[0].log_softmax(-1)
    table = prefix_table(tokenizer)

    def agree(t, g):
        ids = [g] + [int(j) for j in table[g] if j >= 0]
        return -float(torch.logsumexp(lp[t, ids], 0))

    assert float(nats[0]) == pytest.approx(agree(0, 5) + agree(1, 6) + agree(2, 7), rel=1e-5)
    assert float(first[1]) == pytest.approx(agree(4, 9), rel=1e-5)
    assert math.isnan(nats[2]) and math.isnan(first[2]) and math.isnan(margin[2])


def test_the_end_of_turn_token_is_not_answer_text_and_the_forensics_callback_reads_the_trainers_tokenizer(
    tokenizer, tmp_path
):
    """A model unsure where a hard answer stops (the EOS at 12 nats) is not charged for it; the text tokens are."""
    from hf_stable.callbacks.spike_forensics import ForensicsConfig, SpikeForensics
    from hf_stable.forensics.token_prefixes import special_ids, text_mask

    v = len(tokenizer.get_vocab())
    eos, word = tokenizer.eos_token_id, tokenizer.encode("ab", add_special_tokens=False)[0]
    logits = torch.zeros(1, 4, v)
    logits[0, 1, word] = 12.0  # the answer's text: expected
    logits[0, 2, eos] = -12.0  # where it stops: not at all
    labels = torch.tensor([[-100, -100, word, eos]])
    text = text_mask(special_ids(tokenizer), v, "cpu")
    assert not text[eos] and text[word] and int((~text).sum()) == len(set(tokenizer.all_special_ids))
    _, count, with_eos, _, _ = per_sample_answer_stats(logits, labels)
    _, _, text_only, first, _ = per_sample_answer_stats(logits, labels, text=text)
    assert float(count[0]) == 2  # screening's loss still counts the EOS
    assert float(with_eos[0]) > 12 and float(text_only[0]) == pytest.approx(float(first[0]))
    assert float(text_only[0]) < 0.1

    forensics = SpikeForensics(ForensicsConfig(screen=True))
    forensics._init_token_prefixes(tokenizer)
    assert forensics._prefix_source is not None and eos in forensics._special.tolist()
    forensics._init_token_prefixes(None)  # a Trainer without a processing_class: the plain NLL
    assert forensics._prefix_source is None and forensics._special is None
