"""The data audit: its numbers on a dataset with known defects, the `hf-stable audit` command and its JSON keys."""

from __future__ import annotations

import json

import pytest

from hf_stable.cli import main as cli_main
from hf_stable.config import DataConfig
from hf_stable.data import audit_dataset, audit_markdown
from hf_stable.data.audit import length_histogram, padding_ratio
from hf_stable.data.duplicates import duplicate_stats

STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counted the gulls on the rail, "
    "and wrote the weather in a green notebook before lighting the lamp."
)


def _rows():
    rows = [{"instruction": f"What is {a} + {b}?", "input": "", "output": f"{a + b}\n"} for a, b in [(1, 2), (3, 4)]]
    rows.append(dict(rows[0]))  # exact duplicate
    rows.append({"instruction": "Summarise.", "input": STORY, "output": "A keeper's routine."})
    near = STORY.replace("green", "grey")
    rows.append({"instruction": "Summarise.", "input": near, "output": "A keeper's routine."})
    rows.append({"instruction": "Rev\u200berse\x07 the word.", "input": "ti\ufeffger", "output": "regit"})  # 3 chars
    rows.append({"instruction": "Write a long answer.", "input": "", "output": " ".join(["word"] * 300)})  # truncated
    rows.append({"instruction": " ".join(["question"] * 200), "input": "", "output": "x"})  # no room: dropped
    return rows


@pytest.fixture
def dataset(tmp_path):
    lines = [json.dumps(r, ensure_ascii=False) for r in _rows()]
    lines += ['{"instruction": "broken', '{"instruction": "x", "output": 3}']  # bad lines 9 and 10
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tok_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(path)
    return str(path)


def test_audit_numbers_on_known_defects(tokenizer, dataset):
    cfg = DataConfig(train_file=dataset, eval_file=None, max_length=160, on_bad_record="skip", packing=False)
    a = audit_dataset(dataset, tokenizer, cfg, batch_size=4)
    assert a["n_records"] == 10 and a["n_kept"] == 7
    assert a["n_dropped"] == 3
    assert a["dropped_reasons"] == {"invalid_json": 1, "wrong_type": 1, "no_supervised_token": 1}
    assert a["n_cleaned"] == 1 and a["n_chars_removed"] == 3
    assert a["cleaning"]["instruction"] == {"zero_width_removed": 1, "control_removed": 1, "nfc_changed": 0}
    assert a["eos_coverage"] == 1.0
    assert a["n_truncated"] == 1 and a["length"]["max"] == 160
    assert 0 < a["label_coverage"] < 1
    assert a["n_supervised_tokens"] < a["n_tokens"]
    assert a["exact_duplicates"] == 1 and a["near_duplicates"] == 1
    assert a["duplicate_rate"] == pytest.approx(2 / 8)  # over the 8 good records
    assert sum(a["length_histogram"]["counts"]) == 7
    assert a["padding_ratio"] == a["padding_ratio_padded"] > 0
    assert any("truncated" in x for x in a["alerts"]) and any("dropped" in x for x in a["alerts"])
    one_row = DataConfig(max_length=160, on_bad_record="skip", packing_row_tokens=0)
    packed = audit_dataset(dataset, tokenizer, one_row, batch_size=4)
    assert packed["padding_ratio"] == 0.0 and packed["padding_ratio_padded"] == a["padding_ratio"]
    rows = audit_dataset(dataset, tokenizer, DataConfig(max_length=160, on_bad_record="skip"), batch_size=4)
    assert rows["packing_row_tokens"] == 160 and 0 < rows["padding_ratio"] < a["padding_ratio"]


def test_padding_ratio_and_alert(tokenizer, tmp_path):
    assert padding_ratio([2, 8], 2, packing=False) == pytest.approx(6 / 16)
    assert padding_ratio([2, 8], 2, packing=True, pad_to_multiple_of=4) == pytest.approx(2 / 12)
    assert padding_ratio([2, 8], 1, packing=False) == 0.0
    rows = [{"instruction": "hi", "input": "", "output": "x"}] * 15
    rows.append({"instruction": "hi", "input": "", "output": " ".join(["word"] * 150)})
    path = tmp_path / "skewed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    a = audit_dataset(str(path), tokenizer, DataConfig(packing=False, max_length=256), batch_size=16)
    assert a["padding_ratio"] > 0.75
    assert any("padding ratio" in x and "packing" in x for x in a["alerts"])
    assert "⚠ padding ratio" in audit_markdown(a)


def test_duplicate_stats():
    other = "Completely unrelated text about rockets, planets and the summer market in the valley school."
    stats = duplicate_stats([STORY, STORY, STORY.replace("green", "grey"), other])
    assert (stats["exact_duplicates"], stats["near_duplicates"]) == (1, 1)
    assert stats["duplicate_rate"] == 0.5
    assert duplicate_stats([STORY, other])["duplicate_rate"] == 0.0


def test_length_histogram_bins():
    h = length_histogram([5, 8, 9, 200, 256], max_length=256)
    assert h["edges"] == [0, 8, 16, 32, 64, 128, 256]
    assert h["counts"] == [2, 1, 0, 0, 0, 2]


def test_cli_json_keys(dataset, tok_dir, capsys):
    rc = cli_main(["audit", dataset, "--tokenizer", tok_dir, "--json", "--skip-bad", "--max-length", "160"])
    assert rc == 0
    a = json.loads(capsys.readouterr().out)
    for key in ("n_records", "n_dropped", "n_chars_removed", "eos_coverage", "padding_ratio", "duplicate_rate"):
        assert key in a
    assert (a["n_records"], a["n_dropped"], a["n_chars_removed"], a["eos_coverage"]) == (10, 3, 3, 1.0)


def test_cli_text_and_errors(dataset, tok_dir, tmp_path, capsys):
    assert cli_main(["audit", dataset, "--tokenizer", tok_dir, "--skip-bad"]) == 0
    out = capsys.readouterr().out
    assert (
        "records read / kept / dropped | 10 / 7 / 3" in out
        and "stop-token coverage (EOS / end of turn) | 100.0%" in out
    )
    assert cli_main(["audit", dataset, "--tokenizer", tok_dir]) == 2  # bad line 9 without --skip-bad
    assert f"{dataset}:9: malformed JSON" in capsys.readouterr().err
    assert cli_main(["audit", dataset, "--tokenizer", str(tmp_path / "none")]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert cli_main(["audit", str(tmp_path / "missing.jsonl"), "--tokenizer", tok_dir]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err


def test_markdown_for_train_and_eval(tokenizer, dataset):
    a = audit_dataset(dataset, tokenizer, DataConfig(on_bad_record="skip", max_length=160))
    md = audit_markdown({"train": a, "eval": None})
    assert md.startswith("### Data audit: train") and "| stop-token coverage (EOS / end of turn) | 100.0% |" in md
    assert "duplicates (exact + near) | 25.0% (1 + 1)" in md


def test_cli_takes_an_embedded_tokenizer_prints_each_dropped_record_and_names_its_own_flag(
    dataset, tmp_path, monkeypatch, capsys
):
    """`hf-stable audit FILE --tokenizer embedded:tiny-llama` (what the doctor suggests for the default recipe): the
    embedded base's tokenizer without building the base, each dropped record as file:line in the text form, and the
    bad-line error pointing at --skip-bad (the audit's flag), not at a config key."""
    monkeypatch.setenv("HF_STABLE_CACHE", str(tmp_path / "cache"))  # nothing cached: the tokenizer is trained
    assert cli_main(["audit", dataset, "--tokenizer", "embedded:tiny-llama", "--skip-bad", "--max-length", "160"]) == 0
    out = capsys.readouterr().out
    assert "records read / kept / dropped | 10 / 7 / 3" in out
    assert f"  {dataset}:9: malformed JSON" in out and f"  {dataset}:10: field 'output' must be a string" in out
    assert "Dropped records (3):" in out
    assert not (tmp_path / "cache" / "bases").exists()  # no base built for an audit
    assert cli_main(["audit", dataset, "--tokenizer", "embedded:tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert f"{dataset}:9: malformed JSON" in err and "pass --skip-bad" in err and "on_bad_record" not in err
    assert cli_main(["audit", dataset, "--tokenizer", "embedded:tiny-gpt"]) == 2
    assert "--tokenizer: name_or_path: got 'embedded:tiny-gpt', embedded bases are: embedded:tiny-llama" in (
        capsys.readouterr().err
    )


def test_embedded_tokenizer_without_the_base_is_the_built_bases_tokenizer(tmp_path):
    import dataclasses

    from hf_stable.embedded.builder import embedded_tokenizer, ensure_base
    from tests.helpers import TINY

    cfg = dataclasses.replace(TINY, cache_dir=str(tmp_path), pretrain_steps=0)
    before = embedded_tokenizer("llama", cfg)  # trained in memory
    built = ensure_base("llama", cfg)
    after = embedded_tokenizer("llama", cfg)  # read from the cached base
    assert before.get_vocab() == after.get_vocab() and len(before) == len(after)
    assert before.chat_template == after.chat_template and (built / "tokenizer").is_dir()
