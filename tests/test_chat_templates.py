"""What a model is trained on is what its chat template says, on the real Llama-3.1 / Qwen2.5 / Qwen3 tokenizers.

For every case of `tests.real_vocab.CASES` and every conversation below, the supervised tokens are the template's
final assistant turn (through its end-of-turn token, whatever the tokenizer's EOS is), the whole sample is the
template's rendering of the conversation token for token, padded and packed batches keep exactly that span, and
the stop tokens (exact match, generation_config.json) are the turn's end. The vocabularies are checked against
llama.cpp's reference tokenizations first.
"""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from hf_stable.config import DataConfig
from hf_stable.data import IGNORE_INDEX, PackingCollator, PaddingCollator, build_data, encode_prompt, encode_records
from hf_stable.data.records import Record
from hf_stable.reporting import save_generation_config
from tests.real_vocab import ALIGNED_CASES, CASES, reference_cases

QUESTION = {"role": "user", "content": "What is 6 x 7?"}


def _chat(*turns):
    roles = ["user", "assistant"] * len(turns)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, turns, strict=False)]}


def conversations(case) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (the record as written, the conversation the template should render: answer stripped, ends once)."""
    system = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime below 5."}]
    out = {
        "single": (_chat("What is 6 x 7?", "42\n"), _chat("What is 6 x 7?", "42")),
        "system": (
            {"messages": [*system, {"role": "assistant", "content": "3"}]},
            [*system, {"role": "assistant", "content": "3"}],
        ),
        "multi_turn": (_chat("What is 1 + 1?", "2", "And 2 + 2?", "4"),) * 2,
        "chinese": (_chat("把“森林”倒过来写。", "林森"),) * 2,
        "multi_line": (
            _chat("Two lines, please.", "line one\nline two\n"),
            _chat("Two lines, please.", "line one\nline two"),
        ),
        "ends_with_turn_end": (_chat("Say 42.", "42" + case.turn_end), _chat("Say 42.", "42")),
        "ends_with_eos": (_chat("Say 43.", "43" + case.eos), _chat("Say 43.", "43")),
    }
    if case.name == "qwen3":
        out["reasoning"] = (_chat("What is 6 x 7?", "<think>\nsix sevens\n</think>\n\n42"),) * 2
    return {k: (r, e["messages"] if isinstance(e, dict) else e) for k, (r, e) in out.items()}


@pytest.fixture(scope="module", params=list(CASES))
def case_tok(request, real_tokenizer):
    return CASES[request.param], real_tokenizer(request.param)


def expected(case, tok, messages) -> tuple[str, str]:
    """(prompt, final turn) from the template itself; alpaca layout + EOS without one."""
    if case.template is None:
        return None, None
    kw = {}
    if case.name == "qwen3":  # the template's own switch for non-thinking data, thinking on for a reasoning answer
        kw["enable_thinking"] = "</think>" in messages[-1]["content"]
    full = tok.apply_chat_template(messages, tokenize=False, **kw)
    prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False, **kw)
    assert full.startswith(prompt)
    return prompt, full[len(prompt) :].rstrip("\n")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _write(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("vocab", ["llama3", "qwen2"])
def test_vocabularies_match_llama_cpp_reference_tokenizations(real_tokenizer, vocab):
    tok = real_tokenizer.base(vocab)
    cases = reference_cases(real_tokenizer.cache, vocab)
    wrong = [text for text, ids in cases if _ids(tok, text) != ids]
    assert len(cases) == 46 and len(tok) == {"llama3": 128257, "qwen2": 151936}[vocab]
    # llama.cpp and the tokenizers library split one Vietnamese string differently (known, STACK-FACTS.md)
    assert wrong == ([] if vocab == "qwen2" else ["Cửa Việt"])


def test_supervised_span_is_the_templates_final_turn(case_tok, tmp_path):
    case, tok = case_tok
    convs = conversations(case)
    cfg = DataConfig(
        train_file=_write(tmp_path / "t.jsonl", [r for r, _ in convs.values()]), eval_file=None, packing=False
    )
    data = build_data(cfg, tok)
    assert len(data.train_dataset) == len(convs)
    end_id = tok.convert_tokens_to_ids(case.turn_end)
    for (name, (record, messages)), sample in zip(convs.items(), data.train_dataset, strict=True):
        ids, labels = sample["input_ids"], sample["labels"]
        n = labels.count(IGNORE_INDEX)
        supervised = ids[n:]
        assert labels[:n] == [IGNORE_INDEX] * n and labels[n:] == supervised, name
        assert supervised[-1] == end_id and supervised.count(end_id) == 1, name
        assert ids[:n] == encode_prompt(tok, record), name  # exact match asks exactly the training prompt
        prompt, final_turn = expected(case, tok, messages)
        if prompt is None:  # no template: alpaca layout after BOS, then the answer and one EOS
            assert ids[0] == tok.bos_token_id and tok.decode(ids[1:n]).endswith(
                ("### Response:\n", "### Assistant:\n")
            )
            assert tok.decode(supervised) == messages[-1]["content"] + case.eos, name
            continue
        assert tok.decode(supervised) == final_turn and supervised == _ids(tok, final_turn), name
        # the whole sample is the template's rendering of the conversation, token for token
        assert ids == _ids(tok, prompt + final_turn), name
        if case.eos != case.turn_end:  # Qwen2.5 base: <|endoftext|> is never trained as the end of a turn
            assert tok.eos_token_id not in supervised, name


def test_what_each_checkpoint_is_taught_literally(case_tok):
    """The single-turn sample of each case, written out: prompt end and supervised span."""
    case, tok = case_tok
    record = {"instruction": "What is 6 x 7?", "input": "", "output": "42"}
    prompt = tok.decode(encode_prompt(tok, record))
    llama_prompt_end = "What is 6 x 7?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    want = {
        "llama3.1-instruct": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n", llama_prompt_end),
        "llama3.1-base": ("<|begin_of_text|>### Instruction:\n", "What is 6 x 7?\n\n### Response:\n"),
        "qwen2.5-instruct": ("<|im_start|>system\nYou are Qwen", "<|im_start|>assistant\n"),
        "qwen2.5-base": ("<|im_start|>system\nYou are Qwen", "<|im_start|>assistant\n"),
        "qwen3": ("<|im_start|>user\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    }[case.name]
    assert prompt.startswith(want[0]) and prompt.endswith(want[1])
    (sample,), _ = encode_records(tok, [Record(record, "x.jsonl", 1)], max_length=256)
    supervised = [t for t, lab in zip(sample["input_ids"], sample["labels"], strict=True) if lab != IGNORE_INDEX]
    assert tok.decode(supervised) == "42" + case.turn_end
    if case.name == "qwen3":
        reasoning = _chat("What is 6 x 7?", "<think>\nsix sevens\n</think>\n\n42")
        assert tok.decode(encode_prompt(tok, reasoning)).endswith("<|im_start|>assistant\n")
        (sample,), _ = encode_records(tok, [Record(reasoning, "x.jsonl", 2)], max_length=256)
        n = sample["labels"].count(IGNORE_INDEX)
        assert tok.decode(sample["input_ids"][n:]) == "<think>\nsix sevens\n</think>\n\n42<|im_end|>"


def _supervised_rows(batch, packed: bool) -> list[list[int]]:
    """Per sample, the input ids at supervised label positions (packed rows split where positions restart)."""
    rows = []
    for r in range(batch["input_ids"].shape[0]):
        ids, labels = batch["input_ids"][r].tolist(), batch["labels"][r].tolist()
        starts = [k for k, p in enumerate(batch["position_ids"][r].tolist()) if p == 0] if packed else [0]
        for a, b in zip(starts, [*starts[1:], len(ids)], strict=True):
            span = [t for t, lab in zip(ids[a:b], labels[a:b], strict=True) if lab != IGNORE_INDEX]
            if span:
                rows.append(span)
    return rows


@pytest.mark.parametrize("packing", [False, True])
def test_padded_and_packed_batches_keep_the_final_turn(case_tok, tmp_path, packing):
    case, tok = case_tok
    convs = conversations(case)
    cfg = DataConfig(
        train_file=_write(tmp_path / "t.jsonl", [r for r, _ in convs.values()]),
        eval_file=None,
        packing=packing,
        pad_to_multiple_of=16,
        audit=False,
    )
    data = build_data(cfg, tok)
    assert isinstance(data.collator, PackingCollator if packing else PaddingCollator)
    batch = data.collator([data.train_dataset[i] for i in range(len(data.train_dataset))])
    got = _supervised_rows(batch, packing)
    want = []
    for _, messages in convs.values():
        _, final_turn = expected(case, tok, messages)
        want.append(_ids(tok, final_turn if final_turn is not None else messages[-1]["content"] + case.eos))
    assert sorted(got) == sorted(want)


def test_stop_tokens_audit_and_generation_config(case_tok, tmp_path):
    case, tok = case_tok
    convs = conversations(case)
    cfg = DataConfig(
        train_file=_write(tmp_path / "t.jsonl", [r for r, _ in convs.values()]), eval_file=None, packing=True
    )
    data = build_data(cfg, tok)
    want = list(dict.fromkeys([case.turn_end, case.eos]))
    assert tok.convert_ids_to_tokens(data.stop_token_ids) == want
    audit = data.audit["train"]
    assert audit["stop_tokens"] == want and audit["eos_coverage"] == 1.0
    assert audit["sample"]["marked"].endswith("⟦42" + case.turn_end + "⟧")
    assert audit["sample"]["where"].endswith("t.jsonl:1")
    if case.name == "qwen3":
        assert audit["thinking"] == {"off": len(convs) - 1, "on": 1}
        assert "enable_thinking=False" in audit["chat_rendering"]
    elif case.template is None:
        assert audit["chat_rendering"].startswith("no chat template: alpaca layout")
    path = save_generation_config(tmp_path / "out", None, tok, data.stop_token_ids)
    saved = GenerationConfig.from_pretrained(path.parent)
    assert saved.eos_token_id == tok.convert_tokens_to_ids(want)
    assert saved.pad_token_id == (tok.pad_token_id if case.pad else None)


@pytest.mark.parametrize("name", list(ALIGNED_CASES))
def test_templates_whose_generation_prompt_opens_with_think_are_aligned(real_tokenizer, tmp_path, name):
    """QwQ / DeepSeek-R1: the generation prompt opens the reply with <think>, the rendered turn does not; the model
    is trained on the generation prompt followed by what the template writes in the final turn."""
    case, tok = ALIGNED_CASES[name], real_tokenizer(name)
    end = case.turn_end
    rows = [_chat("What is 6 x 7?", "42"), _chat("What is 6 x 7?", "<think>\nsix sevens\n</think>\n\n42")]
    data = build_data(DataConfig(train_file=_write(tmp_path / "t.jsonl", rows), eval_file=None, packing=False), tok)
    spans, prompts = [], []
    for record, sample in zip(rows, data.train_dataset, strict=True):
        n = sample["labels"].count(IGNORE_INDEX)
        assert sample["input_ids"][:n] == encode_prompt(tok, record)
        prompts.append(tok.decode(sample["input_ids"][:n]))
        spans.append(tok.decode(sample["input_ids"][n:]))
    gen_off = tok.apply_chat_template(
        rows[0]["messages"][:1], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert prompts[0] == gen_off and gen_off.endswith("<think>\n</think>")  # exactly what generation is given
    assert spans[0] == "42" + end
    audit = data.audit["train"]
    assert audit["stop_tokens"] == [end] and audit["n_aligned"] >= 1 and "aligned" in audit["chat_rendering"]
    if name == "qwq":  # its template keeps the final turn's reasoning: thinking on, nothing to align
        assert (
            prompts[1].endswith("<|im_start|>assistant\n<think>\n") and spans[1] == "six sevens\n</think>\n\n42" + end
        )
        assert audit["n_aligned"] == 1 and audit["n_reasoning_dropped"] == 0
    else:  # R1 drops the think block from every assistant turn: trained as rendered, and the audit says so
        assert prompts[1].endswith("<｜Assistant｜><think>\n") and spans[1] == "\n\n42" + end
        assert audit["n_aligned"] == 2 and audit["n_reasoning_dropped"] == 1
        assert any("reasoning block" in a for a in audit["alerts"])
