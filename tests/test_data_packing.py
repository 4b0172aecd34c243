"""Packing: exact loss equality with padded batches on tiny Llama/Qwen2/Qwen3, and label invariants (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_stable.data import IGNORE_INDEX, PackingCollator, PaddingCollator, encode_prompt, encode_records
from hf_stable.data.cleaning import CleaningStats, clean_record
from hf_stable.data.collators import pack_rows
from hf_stable.data.records import Record
from hf_stable.embedded.tasks import instruction_dataset
from tests.helpers import make_tiny_model


def _samples(tok, n=6, seed=3):
    rows, _ = instruction_dataset(seed, n_train=n, n_eval=0)
    recs = [Record(r, "mem.jsonl", i + 1) for i, r in enumerate(rows)]
    return encode_records(tok, recs, max_length=256)[0]


def test_packed_batch_layout(tokenizer):
    samples = _samples(tokenizer, n=3)
    lens = [len(s["input_ids"]) for s in samples]
    batch = PackingCollator(tokenizer.pad_token_id)(samples)
    assert batch["input_ids"].shape == (1, sum(lens)) and "attention_mask" not in batch
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["cu_seq_lens_q"].tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert batch["cu_seq_lens_k"].tolist() == batch["cu_seq_lens_q"].tolist()
    assert batch["max_length_q"] == batch["max_length_k"] == max(lens)
    assert batch["position_ids"][0].tolist() == [p for n in lens for p in range(n)]

    multiple = sum(lens) + 3  # forces a 3-token tail
    padded = PackingCollator(tokenizer.pad_token_id, pad_to_multiple_of=multiple)(samples)
    total = padded["input_ids"].shape[1]
    assert total == multiple
    assert padded["cu_seq_lens_q"].tolist()[-2:] == [sum(lens), total]
    assert (padded["labels"][0, sum(lens) :] == IGNORE_INDEX).all()
    assert padded["position_ids"][0, sum(lens) :].tolist() == [0, 1, 2]  # the tail is its own segment


@pytest.mark.parametrize("pad_multiple, row_tokens", [(None, None), (32, None), (None, 64), (16, 64)])
def test_packed_loss_equals_padded_loss(arch, tokenizer_pad_eos, pad_multiple, row_tokens):
    tok = tokenizer_pad_eos  # pad == eos: the hardest case for label masking
    model = make_tiny_model(arch, tok).eval()
    samples = _samples(tok)
    packer = PackingCollator(tok.pad_token_id, pad_multiple, max_row_tokens=row_tokens)
    batch = packer(samples)
    assert batch["input_ids"].shape[0] == (1 if row_tokens is None else 3)  # 6 samples of ~30 tokens in rows <= 64
    with torch.no_grad():
        padded = model(**PaddingCollator(tok.pad_token_id, pad_multiple)(samples), use_cache=False).loss
        packed = model(**batch, use_cache=False).loss
    assert torch.isfinite(padded)
    assert abs(padded.item() - packed.item()) < 1e-5


def test_pack_rows_balances_and_respects_the_limit():
    lengths = [90, 20, 60, 30, 45, 10, 70, 25]
    rows = pack_rows(lengths, 128)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in row) for row in rows]
    assert len(rows) == 3 and max(loads) <= 128 and max(loads) - min(loads) <= 25
    assert pack_rows([600, 10, 20], 512) == [[0], [1, 2]]  # an over-long sample gets its own row
    assert pack_rows([5, 3], None) == [[0, 1]]


def test_packing_has_no_cross_sample_attention(tokenizer):
    """Changing the first sample must not change the second sample's logits inside a packed row."""
    model = make_tiny_model("llama", tokenizer).eval()
    a, b, c = _samples(tokenizer, n=3)
    col = PackingCollator(tokenizer.pad_token_id)
    with torch.no_grad():
        out1 = model(**col([a, c]), use_cache=False).logits[0, len(a["input_ids"]) :]
        out2 = model(**col([b, c]), use_cache=False).logits[0, len(b["input_ids"]) :]
        alone = model(input_ids=torch.tensor([c["input_ids"]]), use_cache=False).logits[0]
    torch.testing.assert_close(out1, out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out1, alone, atol=1e-5, rtol=1e-5)


def test_trainer_step_with_packing_collator(tokenizer, tmp_path):
    """The packing collator is a drop-in Trainer data_collator (remove_unused_columns=False)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    samples = _samples(tokenizer, n=8)
    ds = Dataset.from_dict({k: [s[k] for s in samples] for k in ("input_ids", "labels")})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        report_to=[],
        remove_unused_columns=False,
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    model = make_tiny_model("qwen2", tokenizer)
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=PackingCollator(tokenizer.pad_token_id))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)


# Random unicode plus the pieces that break naive pipelines: invisible/control characters, whitespace, EOS text.
_PIECES = ["\u200b", "\ufeff", "\x00", "\x85", "\n", "\t", " ", "<|end_of_text|>", "<|assistant|>", "7", "ab"]
_TEXT = st.lists(
    st.one_of(st.characters(codec="utf-8", exclude_categories=("Cs",)), st.sampled_from(_PIECES)), max_size=30
).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(_TEXT, _TEXT, _TEXT), min_size=1, max_size=5),
    max_length=st.integers(min_value=8, max_value=80),
    pad_eos=st.booleans(),
    row_tokens=st.sampled_from([None, 40, 80]),
)
def test_label_invariants_property(tokenizer, tokenizer_pad_eos, rows, max_length, pad_eos, row_tokens):
    tok = tokenizer_pad_eos if pad_eos else tokenizer
    eos = tok.eos_token_id
    raw = [{"instruction": i, "input": x, "output": o} for i, x, o in rows]
    records = [Record(clean_record(r, CleaningStats()), "p.jsonl", n + 1) for n, r in enumerate(raw)]
    samples, stats = encode_records(tok, records, max_length=max_length)
    assert stats.n_kept + stats.dropped["no_supervised_token"] == len(rows)
    kept = {s["line"] for s in samples}
    for s in samples:
        prompt = encode_prompt(tok, records[s["line"] - 1].data)
        n = len(prompt)
        assert len(s["input_ids"]) <= max_length
        assert s["input_ids"][:n] == prompt
        assert s["labels"][:n] == [IGNORE_INDEX] * n  # every prompt label is -100
        supervised = [lab for lab in s["labels"] if lab != IGNORE_INDEX]
        assert supervised and supervised[-1] == eos  # the last supervised label is EOS
    for r in records:  # dropped samples are exactly those whose prompt leaves no room
        assert (r.line in kept) == (len(encode_prompt(tok, r.data)) < max_length)
    if not samples:
        return
    padded = PaddingCollator(tok.pad_token_id, pad_to_multiple_of=8)(samples)
    assert ((padded["attention_mask"] == 0) <= (padded["labels"] == IGNORE_INDEX)).all()  # no labelled padding
    for row, s in enumerate(samples):
        assert padded["labels"][row, : len(s["labels"])].tolist() == s["labels"]
    packed = PackingCollator(tok.pad_token_id, max_row_tokens=row_tokens)(samples)
    segments, bounds = [], [0]
    rows_ = zip(packed["input_ids"].tolist(), packed["labels"].tolist(), packed["position_ids"].tolist(), strict=False)
    for ids, labels, pos in rows_:
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in itertools.pairwise(starts):
            assert pos[a:b] == list(range(b - a))  # positions restart at 0 for every sample
            bounds.append(bounds[-1] + b - a)
            if any(lab != IGNORE_INDEX for lab in labels[a:b]):  # tail padding has no label
                segments.append((ids[a:b], labels[a:b]))
    assert packed["cu_seq_lens_q"].tolist() == bounds  # flash-attn varlen boundaries match the positions
    # packing preserves every sample's tokens and labels exactly
    assert sorted(segments) == sorted((s["input_ids"], s["labels"]) for s in samples)
