"""Reading JSONL: every bad-input case names file:line (or is skipped and counted), and cleaning counts per field."""

from __future__ import annotations

import json

import pytest

from hf_stable.config import DataConfig
from hf_stable.data import build_data, clean_text, read_records
from hf_stable.errors import DataError

GOOD = {"instruction": "What is 2 + 3?", "input": "", "output": "5\n", "family": "arithmetic", "lang": "en"}


def write_lines(path, lines: list) -> str:
    """Write JSONL: dicts are dumped, bytes/str are written as they are."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line, ensure_ascii=False)
            f.write((line.encode("utf-8") if isinstance(line, str) else line) + b"\n")
    return str(path)


BAD_LINES = {
    "invalid_json": ('{"instruction": "x", "output": ', "malformed JSON"),
    "missing_field": ({"instruction": "x", "input": ""}, "missing field 'output'"),
    "wrong_type": ({"instruction": "x", "input": "", "output": 5}, "field 'output' must be a string, got int"),
    "non_utf8": (b'{"instruction": "caf\xe9", "output": "y"}', "not valid UTF-8"),
    "not_an_object": ("[1, 2]", "must be a JSON object"),
}


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_line_is_an_error_with_file_and_line(tmp_path, reason):
    bad, message = BAD_LINES[reason]
    path = write_lines(tmp_path / "d.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as err:
        read_records(path)
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)
    assert "on_bad_record: skip" in str(err.value)


def test_skip_mode_skips_and_counts_every_reason(tmp_path):
    lines = [GOOD] + [bad for bad, _ in BAD_LINES.values()] + [GOOD, ""]
    path = write_lines(tmp_path / "d.jsonl", lines)
    result = read_records(path, on_bad_record="skip")
    assert len(result.records) == 2
    assert [r.line for r in result.records] == [1, len(BAD_LINES) + 2]
    assert dict(result.skipped) == {reason: 1 for reason in BAD_LINES}
    assert result.n_lines == len(BAD_LINES) + 2 and result.n_blank == 1
    assert any(f"{path}:2:" in m for m in result.skipped_examples)


def test_empty_file_is_an_error(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    for mode in ("error", "skip"):
        with pytest.raises(DataError, match=r"empty\.jsonl:1: empty file"):
            read_records(path, on_bad_record=mode)


def test_all_bad_lines_in_skip_mode_is_an_error(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ["{oops", "[]"])
    with pytest.raises(DataError, match="all 2 lines are bad"):
        read_records(path, on_bad_record="skip")


def test_missing_file_names_the_config_field(tmp_path, tokenizer):
    cfg = DataConfig(train_file=str(tmp_path / "nope.jsonl"), eval_file=None)
    with pytest.raises(DataError, match=r"data\.train_file: .*nope\.jsonl does not exist"):
        build_data(cfg, tokenizer)
    good = write_lines(tmp_path / "t.jsonl", [GOOD])
    cfg = DataConfig(train_file=good, eval_file=str(tmp_path / "missing_eval.jsonl"))
    with pytest.raises(DataError, match=r"data\.eval_file: .*missing_eval\.jsonl"):
        build_data(cfg, tokenizer)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"messages": "hi"}, "field 'messages' must be a list, got str"),
        ({"messages": []}, "field 'messages' is empty"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "last message must be the assistant answer"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "messages[0] has no 'content'"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role 'bot' is not one of"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content must be a string, got null"),
    ],
)
def test_bad_chat_records(tmp_path, bad, message):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = write_lines(tmp_path / "c.jsonl", [good, bad])
    with pytest.raises(DataError) as err:
        read_records(path)
    assert f"{path}:2:" in str(err.value) and message in str(err.value)


def test_format_is_decided_by_the_first_record(tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = write_lines(tmp_path / "mixed.jsonl", [GOOD, chat])
    with pytest.raises(DataError, match=r"mixed\.jsonl:2: record is chat but the file's format is alpaca"):
        read_records(path)
    assert read_records(path, format="chat", on_bad_record="skip").format == "chat"


def test_input_may_be_missing_or_null_and_extra_keys_are_kept(tmp_path):
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "c", "input": None, "output": "d", "family": "f"}]
    result = read_records(write_lines(tmp_path / "d.jsonl", rows))
    assert [r.data["input"] for r in result.records] == ["", ""]
    assert result.records[1].data["family"] == "f"


def test_clean_text_removes_zero_width_and_controls_keeps_newline_and_tab():
    dirty = "a\u200bb\u200cc\u200dd\u2060e\ufefff\x00g\x07h\x1bi\x7fj\x85k\x9fl\r\n\tm"
    out, n_zw, n_ctrl, nfc = clean_text(dirty)
    assert out == "abcdefghijkl\n\tm"
    assert (n_zw, n_ctrl, nfc) == (5, 7, False)
    out, _, _, nfc = clean_text("e\u0301")  # e + combining acute -> precomposed é
    assert out == "\u00e9" and nfc


def test_cleaning_counts_per_field_and_keeps_bom_free_first_line(tmp_path):
    rows = [
        {"instruction": "Rev\u200berse\x07", "input": "ab\ufeffc", "output": "cba"},
        {"instruction": "ok", "input": "", "output": "fine\x85"},
        {"messages": [{"role": "user", "content": "q\u2060"}, {"role": "assistant", "content": "a"}]},
    ]
    path = tmp_path / "d.jsonl"
    write_lines(path, rows[:2])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # a BOM from a Windows editor
    result = read_records(str(path))
    assert result.records[0].data == {"instruction": "Reverse", "input": "abc", "output": "cba"}
    assert result.records[1].data["output"] == "fine"
    stats = result.cleaning.to_dict()
    assert stats["records_changed"] == 2 and stats["chars_removed"] == 4
    per = stats["per_field"]
    assert per["instruction"]["zero_width_removed"] == 1 and per["instruction"]["control_removed"] == 1
    assert per["input"]["zero_width_removed"] == 1 and per["output"]["control_removed"] == 1
    chat = read_records(write_lines(tmp_path / "c.jsonl", rows[2:]))
    assert chat.records[0].data["messages"][0]["content"] == "q"
    assert chat.cleaning.to_dict()["per_field"]["messages.user"]["zero_width_removed"] == 1


def test_clean_false_keeps_text(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [{"instruction": "a\u200b", "output": "b"}])
    assert read_records(path, clean=False).records[0].data["instruction"] == "a\u200b"


def test_lone_surrogate_is_a_bad_line_but_a_surrogate_pair_is_text(tmp_path):
    lone = '{"instruction": "1 + 1?", "output": "2 \\ud800"}'
    pair = '{"instruction": "smile", "output": "\\ud83d\\ude00"}'  # one emoji, written as a UTF-16 pair
    path = write_lines(tmp_path / "d.jsonl", [GOOD, pair, lone])
    with pytest.raises(DataError, match=r"d\.jsonl:3: field 'output' holds a lone surrogate \\ud800 at character 2"):
        read_records(path)
    result = read_records(path, on_bad_record="skip")
    assert [r.line for r in result.records] == [1, 2] and result.records[1].data["output"] == "\U0001f600"
    assert dict(result.skipped) == {"invalid_unicode": 1}


def test_answer_empty_after_cleaning_is_dropped_and_counted_or_an_error(tmp_path, tokenizer):
    from hf_stable.data import audit_markdown

    empty = [
        {"instruction": "say nothing", "input": "", "output": "  \n\t "},
        {"instruction": "invisible", "input": "", "output": "\u200b\u2060\x07"},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\ufeff "}]},
    ]
    path = write_lines(tmp_path / "d.jsonl", [GOOD, *empty[:2], GOOD])
    with pytest.raises(DataError, match=r"d\.jsonl:2: field 'output' is empty after cleaning"):
        read_records(path)
    cfg = DataConfig(train_file=path, eval_file=None, on_bad_record="skip")
    data = build_data(cfg, tokenizer)
    audit = data.audit["train"]
    assert (audit["n_records"], audit["n_kept"], audit["dropped_reasons"]) == (4, 2, {"empty_answer": 2})
    assert "empty_answer: 2" in audit_markdown(audit)  # what the model card shows
    chat = write_lines(tmp_path / "c.jsonl", [empty[2]])
    with pytest.raises(DataError, match=r"c\.jsonl:1: the last message's content is empty after cleaning"):
        read_records(chat)
