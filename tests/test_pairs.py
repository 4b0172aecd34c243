"""Preference pairs (DPO data): file:line errors or skip-and-count, cleaning, the SFT rendering, the audit, the
embedded pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_stable.cli import main as cli_main
from hf_stable.config import DataConfig
from hf_stable.data import encode_prompt, read_records
from hf_stable.data.audit_pairs import audit_pairs
from hf_stable.data.pairs import read_pairs, render_pairs
from hf_stable.embedded.pairs import preference_pairs
from hf_stable.embedded.tasks import instruction_dataset
from hf_stable.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6", "family": "arithmetic"}
CHAT = {
    "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
    "chosen": [{"role": "assistant", "content": "5"}],
    "rejected": [{"role": "assistant", "content": "6"}],
}


def write_lines(path, lines: list) -> str:
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line, ensure_ascii=False)
            f.write((line.encode("utf-8") if isinstance(line, str) else line) + b"\n")
    return str(path)


BAD_LINES = {
    "invalid_json": ('{"prompt": "x", "chosen": ', "malformed JSON"),
    "missing_field": ({"prompt": "x", "chosen": "a"}, "missing field 'rejected'"),
    "wrong_type": ({"prompt": "x", "chosen": "a", "rejected": 3}, "field 'rejected' must be a string"),
    "bad_messages": (
        {**CHAT, "chosen": [{"role": "user", "content": "5"}]},
        "the last message of 'chosen' must be the assistant answer",
    ),
    "same_answers": ({"prompt": "x", "chosen": " 5\n", "rejected": "5"}, "'chosen' and 'rejected' are the same"),
    "empty_answer": (
        {"prompt": "x", "chosen": "5", "rejected": "\u200b \x07"},
        "field 'rejected' has an empty answer",
    ),
    "format_mismatch": (CHAT, "record is a chat pair but the file's pairs are text"),
}


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_pair_is_an_error_naming_file_and_line(tmp_path, reason):
    bad, message = BAD_LINES[reason]
    path = write_lines(tmp_path / "p.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as err:
        read_pairs(path)
    assert f"{path}:3: " in str(err.value) and message in str(err.value)
    assert "on_bad_record: skip" in str(err.value)


def test_skip_mode_skips_and_counts_bad_pairs_and_cleans_the_rest(tmp_path):
    dirty = {"prompt": "What is 2\u200b + 3?", "chosen": "5\x07", "rejected": "6", "family": "arithmetic"}
    lines = [GOOD] + [bad for bad, _ in BAD_LINES.values()] + [dirty]
    result = read_pairs(write_lines(tmp_path / "p.jsonl", lines), on_bad_record="skip")
    assert dict(result.skipped) == {reason: 1 for reason in BAD_LINES}
    assert [r.line for r in result.records] == [1, len(BAD_LINES) + 2]
    assert result.records[1].data == GOOD  # cleaned to the good record, extra keys kept
    # counted per field; the empty_answer line was cleaned (2 characters) before it was found empty, as for SFT
    assert result.cleaning.records_changed == 2 and result.cleaning.chars_removed == 4
    assert dict(result.cleaning.zero_width_removed) == {"prompt": 1, "rejected": 1}
    assert dict(result.cleaning.control_removed) == {"chosen": 1, "rejected": 1}


def test_a_pair_renders_as_the_sft_record_of_the_same_question(tmp_path, tokenizer):
    text = read_pairs(write_lines(tmp_path / "t.jsonl", [GOOD])).records
    chat = read_pairs(write_lines(tmp_path / "c.jsonl", [CHAT])).records
    (t,), (c,) = render_pairs(tokenizer, text), render_pairs(tokenizer, chat)
    assert t["family"] == "arithmetic"
    assert {k: t[k] for k in ("prompt", "chosen", "rejected")} == c
    sft = {"instruction": "What is 2 + 3?", "input": "", "output": "5"}
    prompt_ids = tokenizer(t["prompt"], add_special_tokens=False).input_ids
    assert prompt_ids == encode_prompt(tokenizer, sft)  # the question DPO trains on is the SFT question
    eos = tokenizer.eos_token
    assert t["chosen"] == "5" + eos and t["rejected"] == "6" + eos  # each answer ends with the end-of-turn token


def test_audit_counts_pair_drops_and_measures_both_sides(tmp_path, tokenizer):
    long_prompt = {"prompt": " ".join(["question"] * 200), "chosen": "a", "rejected": "b"}
    same_start = {"prompt": "Write.", "chosen": "word " * 100 + "yes", "rejected": "word " * 100 + "no"}
    lines = [GOOD, long_prompt, same_start, {"prompt": "x", "chosen": "y"}, CHAT]
    path = write_lines(tmp_path / "p.jsonl", lines)
    cfg = DataConfig(train_file=path, eval_file=None, max_length=64, on_bad_record="skip", packing=False)
    a = audit_pairs(path, tokenizer, cfg, batch_size=2)
    assert a["kind"] == "pairs" and a["n_pairs"] == a["n_kept"] == 1
    assert a["dropped_reasons"] == {
        "missing_field": 1,
        "format_mismatch": 1,
        "no_supervised_token": 1,
        "same_after_truncation": 1,
    }
    assert any(f"{path}:3: chosen and rejected are the same tokens" in e for e in a["dropped_examples"])
    assert a["eos_coverage"] == a["rejected"]["eos_coverage"] == 1.0
    assert a["rejected"]["n_truncated"] == 1 and any("rejected answers truncated" in x for x in a["alerts"])


def test_audit_command_recognises_a_pair_file(tmp_path, tokenizer, capsys):
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    assert cli_main(["audit", "embedded:pairs_eval", "--tokenizer", str(tok_dir), "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert (a["kind"], a["n_pairs"], a["n_dropped"], a["eos_coverage"]) == ("pairs", 200, 0, 1.0)
    assert a["file"] == "embedded:pairs_eval" and not a["alerts"]
    assert cli_main(["audit", "embedded:eval", "--tokenizer", str(tok_dir), "--json"]) == 0
    assert "kind" not in json.loads(capsys.readouterr().out)  # an SFT file is still audited as one


def test_embedded_pairs_are_deterministic_held_out_and_wrong_where_they_should_be():
    train, held = preference_pairs(0)
    assert (train, held) == preference_pairs(0) and len(train) == 1000 and len(held) == 200
    for name, rows in (("pairs_train", train), ("pairs_eval", held)):
        committed = (ROOT / "data" / "embedded" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in committed] == rows
        assert read_pairs(f"embedded:{name}").n_lines == len(rows)
    _, sft_eval = instruction_dataset(0)
    sft_eval_prompts = {encode_key(r["instruction"], r["input"]) for r in sft_eval}
    train_prompts, held_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in held}
    assert not train_prompts & held_prompts and not (train_prompts | held_prompts) & sft_eval_prompts
    assert len(train_prompts) == len(train)
    assert {r["family"] for r in train} == {"arithmetic", "reversal", "unit_conversion", "sentiment"}
    assert all(r["chosen"] != r["rejected"] for r in train + held)
    for r in train + held:  # chosen is the computed answer
        if r["family"] == "arithmetic" and r["lang"] == "en":
            a, b = (int(x) for x in r["prompt"].removeprefix("What is ").rstrip("?").split(" + "))
            assert r["chosen"] == str(a + b) != r["rejected"]
        if r["family"] == "reversal":
            assert r["chosen"] == r["prompt"].split("\n\n")[1][::-1]


def encode_key(instruction: str, extra: str) -> str:
    return f"{instruction}\n\n{extra}" if extra else instruction


def test_sft_reader_still_reads_sft_files_only(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [GOOD])
    with pytest.raises(DataError, match="neither 'messages'"):
        read_records(path)


def test_build_pairs_keeps_each_train_rows_file_and_line(tmp_path, tokenizer):
    """`PairsBundle.train_where` is aligned with the train dataset (a skipped or dropped line leaves no gap): the DPO
    stage hands it to `stabilize(records=...)`, so a skipped step names its pairs by file:line."""
    from hf_stable.data.pairs_bundle import build_pairs

    other = {**GOOD, "prompt": "What is 4 + 4?", "chosen": "8", "rejected": "9"}
    path = write_lines(tmp_path / "p.jsonl", [GOOD, {"prompt": "x", "chosen": "y"}, other])
    cfg = DataConfig(train_file=path, eval_file=None, max_length=64, on_bad_record="skip", packing=False)
    pairs = build_pairs(cfg, tokenizer)
    assert pairs.train_where == [f"{path}:1", f"{path}:3"] and len(pairs.train_dataset) == 2
