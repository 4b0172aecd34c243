"""Prompts, labels, EOS, truncation and vocab checks on the real tiny tokenizers and Llama-3 / Qwen templates."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from hf_stable.config import DataConfig
from hf_stable.data import (
    IGNORE_INDEX,
    PaddingCollator,
    build_data,
    build_sample,
    encode_prompt,
    encode_records,
    prompt_text,
    read_records,
    reference_answer,
)
from hf_stable.data.records import Record
from hf_stable.embedded.tasks import instruction_dataset
from hf_stable.errors import DataError

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _variant(tokenizer, tmp_path, name, template, specials, eos):
    tokenizer.save_pretrained(tmp_path / name)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / name)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.eos_token = eos
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def llama3_tok(tokenizer, tmp_path_factory):
    specials = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return _variant(tokenizer, tmp_path_factory.mktemp("tok"), "llama3", LLAMA3_TEMPLATE, specials, "<|eot_id|>")


@pytest.fixture(scope="module")
def qwen_tok(tokenizer, tmp_path_factory):
    specials = ["<|im_start|>", "<|im_end|>"]
    return _variant(tokenizer, tmp_path_factory.mktemp("tok"), "qwen", QWEN_TEMPLATE, specials, "<|im_end|>")


def _encode(tok, rows, max_length=256, **kw):
    recs = [Record(r, "mem.jsonl", i + 1) for i, r in enumerate(rows)]
    return encode_records(tok, recs, max_length=max_length, **kw)


def _check_sample(tok, sample, prompt_ids, answer):
    ids, labels = sample["input_ids"], sample["labels"]
    n = len(prompt_ids)
    assert ids[:n] == prompt_ids
    assert labels[:n] == [IGNORE_INDEX] * n
    assert labels[n:] == ids[n:]
    assert ids[-1] == tok.eos_token_id and labels[-1] == tok.eos_token_id
    assert ids[n:].count(tok.eos_token_id) == 1  # (Llama-3 style prompts hold <|eot_id|> too)
    assert tok.decode(ids[n:-1]) == answer


ROWS = [
    {"instruction": "What is 2 + 3?", "input": "", "output": "5\n"},
    {"instruction": "Reverse the letters of the word.", "input": "apple", "output": "elppa"},
    {"instruction": "把 2 千米 换算成米。", "input": "", "output": "2000 米"},
]


@pytest.mark.parametrize("which", ["tokenizer", "tokenizer_pad_eos", "llama3_tok", "qwen_tok"])
def test_prompt_masked_answer_and_single_eos_supervised(request, which):
    tok = request.getfixturevalue(which)
    samples, stats = _encode(tok, ROWS)
    assert stats.n_kept == 3 and not stats.dropped
    for row, s in zip(ROWS, samples, strict=False):
        _check_sample(tok, s, encode_prompt(tok, row), row["output"].strip())


@pytest.mark.parametrize("which", ["llama3_tok", "qwen_tok", "tokenizer"])
def test_prompt_plus_answer_is_what_the_template_renders(request, which):
    """Our prompt + answer + EOS equals the template's own rendering of the whole conversation."""
    tok = request.getfixturevalue(which)
    row = ROWS[1]
    full = tok.apply_chat_template(
        [
            {"role": "user", "content": "Reverse the letters of the word.\n\napple"},
            {"role": "assistant", "content": "elppa"},
        ],
        tokenize=False,
    )
    ours = prompt_text(tok, row) + "elppa" + tok.eos_token
    assert full.rstrip("\n") == ours  # Qwen style writes a newline after <|im_end|>: never supervised
    assert tok.decode(_encode(tok, [row])[0][0]["input_ids"]) == ours


def test_llama3_and_qwen_prompt_shapes(llama3_tok, qwen_tok):
    row = ROWS[0]
    assert prompt_text(llama3_tok, row).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prompt_text(qwen_tok, row) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    for tok, eos in ((llama3_tok, "<|eot_id|>"), (qwen_tok, "<|im_end|>")):
        s = _encode(tok, [row])[0][0]
        supervised = [t for t, lab in zip(s["input_ids"], s["labels"], strict=False) if lab != IGNORE_INDEX]
        assert tok.decode(supervised) == "5" + eos


def test_alpaca_fallback_without_chat_template(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "plain")
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "plain")
    tok.chat_template = None
    row = ROWS[1]
    ids = encode_prompt(tok, row)
    assert ids[0] == tok.bos_token_id
    expected = "### Instruction:\nReverse the letters of the word.\n\n### Input:\napple\n\n### Response:\n"
    assert tok.decode(ids[1:]) == expected
    s = _encode(tok, [row])[0][0]
    _check_sample(tok, s, ids, "elppa")
    with pytest.raises(DataError, match="data.template: chat_template, but the tokenizer has no chat template"):
        encode_prompt(tok, row, template="chat_template")
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    assert tok.decode(encode_prompt(tok, chat)[1:]) == "### System:\nBe brief.\n\n### User:\nhi\n\n### Assistant:\n"


def test_multi_turn_chat_supervises_only_the_last_answer(tokenizer):
    chat = {
        "messages": [
            {"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "And 2 + 2?"},
            {"role": "assistant", "content": "4"},
        ]
    }
    s = _encode(tokenizer, [chat])[0][0]
    supervised = [t for t, lab in zip(s["input_ids"], s["labels"], strict=False) if lab != IGNORE_INDEX]
    assert tokenizer.decode(supervised) == "4" + tokenizer.eos_token
    assert reference_answer(chat) == "4"


def test_eos_in_answer_text_is_not_doubled(tokenizer):
    row = {"instruction": "Say yes.", "input": "", "output": "yes" + tokenizer.eos_token}
    s = _encode(tokenizer, [row])[0][0]
    assert s["input_ids"].count(tokenizer.eos_token_id) == 1 and s["input_ids"][-1] == tokenizer.eos_token_id


def test_trailing_newline_or_not_teaches_the_same_ending(tokenizer):
    a, b = _encode(tokenizer, [ROWS[0], {**ROWS[0], "output": "5"}])[0]
    assert a == {**b, "line": a["line"], "record_id": a["record_id"]}


def test_reference_answer_is_cleaned_and_stripped():
    assert reference_answer({"instruction": "x", "output": " 4\u200b2\x07\n"}) == "42"
    assert reference_answer({"messages": [{"role": "assistant", "content": "ok\n"}]}) == "ok"


def test_eval_records_prompts_match_training_prompts_for_dirty_data(tokenizer, tmp_path):
    dirty = {"instruction": "What is 2 +\u200b 3?\x07", "input": "", "output": "5\ufeff\n"}
    clean = {"instruction": "What is 2 + 3?", "input": "", "output": "5"}
    path = write_jsonl(tmp_path / "d.jsonl", [dirty])
    data = build_data(DataConfig(train_file=path, eval_file=path, audit=False), tokenizer)
    record = data.eval_records[0]
    prompt = encode_prompt(tokenizer, clean)
    assert encode_prompt(tokenizer, record) == prompt
    assert data.train_dataset[0]["input_ids"][: len(prompt)] == prompt
    assert reference_answer(record) == "5" and data.audit == {}


def test_truncation_keeps_eos_and_prompt(tokenizer_pad_eos):
    tok = tokenizer_pad_eos
    row = {"instruction": "Reverse the letters of the word.", "input": "", "output": "a b c d e f g h i j k l m n"}
    prompt = encode_prompt(tok, row)
    limit = len(prompt) + 4
    samples, stats = _encode(tok, [row], max_length=limit)
    s = samples[0]
    assert len(s["input_ids"]) == limit and stats.n_truncated == 1
    assert s["input_ids"][: len(prompt)] == prompt
    assert s["input_ids"][-1] == tok.eos_token_id and s["labels"][-1] == tok.eos_token_id
    assert sum(lab != IGNORE_INDEX for lab in s["labels"]) == 4


def test_sample_without_room_for_supervision_is_dropped_and_counted(tokenizer):
    long_row = {"instruction": "word " * 40, "input": "", "output": "x"}
    samples, stats = _encode(tokenizer, [ROWS[0], long_row], max_length=24)
    assert len(samples) == 1 and stats.dropped == {"no_supervised_token": 1}
    assert "mem.jsonl:2:" in stats.dropped_examples[0]
    assert build_sample([1, 2, 3], [9], 3) is None
    assert build_sample([1, 2], [5, 6, 9], 3) == ([1, 2, 9], [IGNORE_INDEX, IGNORE_INDEX, 9], True)


def test_token_id_beyond_vocab_names_the_sample(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [ROWS[1], ROWS[0]])
    recs = read_records(path).records
    # a model vocabulary one short of the largest id used: the first record holding that id is named
    maxima = [max(encode_records(tokenizer, [r], max_length=256)[0][0]["input_ids"]) for r in recs]
    big = max(maxima)
    line = maxima.index(big) + 1
    with pytest.raises(DataError, match=rf"t\.jsonl:{line}: token id {big} is outside the vocabulary \[0, {big}\)"):
        encode_records(tokenizer, recs, max_length=256, vocab_size=big)
    assert len(encode_records(tokenizer, recs, max_length=256, vocab_size=big + 1)[0]) == 2


def test_padding_collator_masks_padding_by_position_with_pad_eq_eos(tokenizer_pad_eos):
    tok = tokenizer_pad_eos
    assert tok.pad_token_id == tok.eos_token_id
    samples, _ = _encode(tok, ROWS)
    batch = PaddingCollator(tok.pad_token_id, pad_to_multiple_of=16)(samples)
    assert batch["input_ids"].shape[1] % 16 == 0
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        assert batch["labels"][row, n - 1].item() == tok.eos_token_id  # the real EOS stays supervised
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].sum().item() == n
        assert batch["input_ids"][row, :n].tolist() == s["input_ids"]


def test_collator_refuses_an_all_masked_batch(tokenizer):
    with pytest.raises(DataError, match="no supervised token"):
        PaddingCollator(tokenizer.pad_token_id)([{"input_ids": [1, 2], "labels": [IGNORE_INDEX, IGNORE_INDEX]}])


def test_build_data_on_embedded_like_data(tokenizer, tmp_path):
    train, evals = instruction_dataset(0, n_train=120, n_eval=12)
    cfg = DataConfig(
        train_file=write_jsonl(tmp_path / "train.jsonl", train),
        eval_file=write_jsonl(tmp_path / "eval.jsonl", evals),
        packing=False,
    )
    data = build_data(cfg, tokenizer, output_dir=str(tmp_path / "out"))
    assert data.train_dataset.column_names == ["input_ids", "labels", "record_id"] and len(data.train_dataset) == 120
    assert len(data.eval_dataset) == 12 and len(data.eval_records) == 12
    assert data.eval_records[0]["family"] == evals[0]["family"]  # extra keys kept
    assert reference_answer(data.eval_records[0]) == evals[0]["output"].strip()
    assert data.stats["train"]["cleaned"] == sum(
        any(
            ch in json.dumps(r)
            for ch in ("\\u200b", "\\ufeff", "\\u200d", "\\u2060", "\\u0007", "\\u001b", "\\u0000", "\\u0085")
        )
        for r in train
    )
    assert isinstance(data.collator, PaddingCollator) and data.collator.padding_side == "right"
    batch = data.collator([data.train_dataset[i] for i in range(4)])
    assert (batch["labels"] != IGNORE_INDEX).any()
    assert (tmp_path / "out" / "data_audit.json").is_file()


# the turn ends with plain text: nothing generation could stop at
PLAIN_END = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# the generation prompt opens a reply the rendered assistant turn never has
OTHER_OPENING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'A: ' + m['content'] + eos_token }}"
    "{% else %}{{ '<|user|>\n' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template, message",
    [
        (PLAIN_END, "ends the final assistant turn with '5', not with a special token"),
        (OTHER_OPENING, "does not match how its rendering of the conversation opens the final turn"),
    ],
)
def test_a_template_that_breaks_the_rule_is_an_error_naming_the_line(tokenizer, tmp_path, template, message):
    tokenizer.save_pretrained(tmp_path / "tok")
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")
    tok.chat_template = template
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DataError, match=r"t\.jsonl:1: the chat template") as err:
        build_data(DataConfig(train_file=path, audit=False), tok)
    assert message in str(err.value)
