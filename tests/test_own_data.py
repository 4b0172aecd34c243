"""A user's own chat file: evaluation on a held-out split of it (eval_file: auto), dropped records named on the
console, no false "indexing errors" warning from the tokenizer, and exact match only where answers can match."""

from __future__ import annotations

import json
import logging
import os

import pytest
from transformers import PreTrainedTokenizerFast

from hf_stable.config import DataConfig
from hf_stable.data import build_data
from hf_stable.data.holdout import holdout_size, resolve_eval_file
from hf_stable.evaluation import exact_match_skip_reason


def chat(i: int, answer: str | None = None) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": answer if answer is not None else str(2 * i)},
        ]
    }


def write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_own_train_file_is_evaluated_on_a_seeded_held_out_split_of_it(tokenizer, tmp_path, caplog):
    path = write(tmp_path / "my_chats.jsonl", [chat(i) for i in range(40)])
    with caplog.at_level(logging.INFO, logger="hf_stable"):
        data = build_data(DataConfig(train_file=path, audit=False), tokenizer, seed=42)
    line = [r.getMessage() for r in caplog.records if "held out" in r.getMessage()]
    assert len(line) == 1 and f"evaluating on 4 of 40 records held out of {path}" in line[0] and "seed 42" in line[0]
    assert data.eval_source == f"4 records held out of {path} (seed 42)"  # what the model card says
    assert len(data.train_dataset) == 36 and len(data.eval_dataset) == 4
    held = {r["messages"][1]["content"] for r in data.eval_records}
    lines = {data.records[i].where for i in data.train_dataset["record_id"]}
    assert len(lines) == 36 and all(w.startswith(path + ":") for w in lines)
    file_lines = (tmp_path / "my_chats.jsonl").read_text(encoding="utf-8").splitlines()
    trained = {json.loads(file_lines[int(w.rsplit(":", 1)[1]) - 1])["messages"][1]["content"] for w in lines}
    assert len(held) == 4 and not held & trained  # held out = never trained on
    again = build_data(DataConfig(train_file=path, audit=False), tokenizer, seed=42)
    other = build_data(DataConfig(train_file=path, audit=False), tokenizer, seed=7)
    assert again.eval_records == data.eval_records  # the same records on every rank and on resume
    assert other.eval_records != data.eval_records
    assert data.eval_answer_tokens and max(data.eval_answer_tokens) <= 4  # "2 * i" + end of turn: short


def test_auto_means_embedded_eval_only_for_the_embedded_train_set():
    assert resolve_eval_file("embedded:train", "auto") == "embedded:eval"
    assert resolve_eval_file("my.jsonl", "auto") == "auto"
    assert resolve_eval_file("my.jsonl", "embedded:eval") == "embedded:eval"  # asked for explicitly
    assert resolve_eval_file("my.jsonl", None) is None
    assert DataConfig().eval_file == "auto"
    assert [holdout_size(n, 0.1, 200) for n in (1, 2, 5, 40, 10_000)] == [0, 1, 1, 4, 200]
    assert DataConfig(eval_fraction=1.5, eval_max_records=0).validate() == [
        "eval_fraction: got 1.5, must be in (0, 1)",
        "eval_max_records: got 0, must be >= 1",
    ]


def test_a_one_record_file_says_it_cannot_hold_any_out(tokenizer, tmp_path, caplog):
    path = write(tmp_path / "one.jsonl", [chat(1)])
    with caplog.at_level(logging.INFO, logger="hf_stable"):
        data = build_data(DataConfig(train_file=path, audit=False), tokenizer)
    assert data.eval_dataset is None and data.eval_source is None and len(data.train_dataset) == 1
    assert any("too few to hold any out: no evaluation" in r.getMessage() for r in caplog.records)


def test_exact_match_runs_only_where_answers_fit_the_generation_budget():
    assert exact_match_skip_reason([3, 4, 5, 8] * 10, 8) is None
    assert exact_match_skip_reason([3] * 5 + [40] * 5, 8) is None  # half fit: the median answer can match
    assert exact_match_skip_reason([3] * 4 + [40] * 5, 8) is not None
    reason = exact_match_skip_reason([120, 300, 5, 90], 32)
    assert reason.startswith("exact match skipped: 3 of 4 eval answers are longer than evaluation.max_new_tokens 32")
    assert exact_match_skip_reason([], 32) is None


def fresh(tokenizer, tmp_path, name: str, model_max_length: int) -> PreTrainedTokenizerFast:
    """A copy that has not yet said its once-per-tokenizer length warning."""
    tokenizer.save_pretrained(tmp_path / name)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / name)
    tok.model_max_length = model_max_length
    return tok


def test_dropped_records_are_named_and_the_false_length_warning_is_not_shown(tokenizer, tmp_path, caplog):
    long = " ".join(["word"] * 400)
    rows = [chat(i) for i in range(10)]
    rows[1] = chat(1, answer="  ")  # empty answer (line 2)
    rows[3] = '{"messages": [}'  # malformed (line 4)
    rows[5] = {"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "x"}]}  # line 6
    rows[6] = chat(6, answer="\u200b")  # line 7
    rows[8] = {"messages": [{"role": "bot", "content": "hi"}]}  # line 9
    path = write(tmp_path / "mine.jsonl", rows)
    tok = fresh(tokenizer, tmp_path, "tok", 128)
    cfg = DataConfig(train_file=path, eval_file=None, on_bad_record="skip", max_length=128)
    with caplog.at_level(logging.INFO, logger="hf_stable"):
        build_data(cfg, tok, output_dir=str(tmp_path / "out"))
    named = [r.getMessage() for r in caplog.records if "record(s) dropped" in r.getMessage()]
    assert len(named) == 1, named
    lines = named[0].splitlines()
    assert lines[0] == "data.train_file: 5 record(s) dropped:"
    assert lines[1].strip().startswith(f"{path}:2: the last message's content is empty")
    assert lines[2].strip().startswith(f"{path}:4: malformed JSON")
    assert lines[3].strip().startswith(f"{path}:7: the last message's content is empty")
    assert lines[4].strip() == f"+2 more, see {tmp_path / 'out' / 'data_audit.json'}"
    too_long = "Token indices sequence length is longer than"
    assert not [r for r in caplog.records if too_long in r.getMessage()]
    # the same record tokenized outside the pipeline still gets transformers' warning (the filter is scoped)
    fresh(tokenizer, tmp_path, "tok2", 128)(long)
    assert [r for r in caplog.records if too_long in r.getMessage()]


@pytest.mark.parametrize("n_bad", [1, 3])
def test_a_few_drops_are_all_named_without_a_more_line(tokenizer, tmp_path, caplog, n_bad):
    rows = [chat(i) for i in range(6)]
    for k in range(n_bad):
        rows[k] = chat(k, answer=" ")
    path = write(tmp_path / "few.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="hf_stable"):
        build_data(DataConfig(train_file=path, eval_file=None, on_bad_record="skip", audit=False), tokenizer)
    named = next(r.getMessage() for r in caplog.records if "record(s) dropped" in r.getMessage()).splitlines()
    assert len(named) == 1 + n_bad and "more" not in named[-1]


@pytest.mark.slow
def test_the_recipe_on_a_users_chat_file_evaluates_on_it_and_names_what_it_dropped(tmp_path):
    """`scripts/finetune.py --data.train_file my_chats.jsonl`: the eval set is held out of that file (one line,
    model card), exact match is skipped with its reason (long answers), and the dropped records are named."""
    import subprocess
    import sys

    from tests.dist_scripts.harness import tiny_base_args
    from tests.helpers import ROOT

    rows = [
        chat(i, f"The sum of {i} and {i} is {2 * i}. " + "Adding a number to itself doubles it. " * 3)
        for i in range(40)
    ]
    rows[2] = chat(2, answer=" ")
    rows[5] = {"messages": [{"role": "user", "content": "long " * 3000}, {"role": "assistant", "content": "x"}]}
    path = write(tmp_path / "my_chats.jsonl", rows)
    out = tmp_path / "out"
    argv = [*tiny_base_args(tmp_path / "bases"), "--data.train_file", path, "--data.on_bad_record", "skip"]
    argv += [
        "--training.max_steps",
        "2",
        "--training.per_device_train_batch_size",
        "8",
        "--training.output_dir",
        str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "finetune.py"), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"data: evaluating on 4 of 39 records held out of {path} (data.eval_file: auto, seed 42)" in log
    assert "arithmetic" not in log  # nothing of the embedded eval set
    assert f"{path}:3: the last message's content is empty after cleaning" in log
    assert f"{path}:6: prompt is " in log
    skipped = "exact match skipped: 4 of 4 eval answers are longer than evaluation.max_new_tokens"
    assert log.count(skipped) == 2  # before and after training
    card = (out / "README.md").read_text(encoding="utf-8")
    assert f"- eval: `4 records held out of {path} (seed 42)`" in card


def test_the_doctors_audit_advice_is_a_command_that_runs(tmp_path, monkeypatch, capsys):
    """The doctor's fix for a data-audit warning is the exact `hf-stable audit` command for this config (file,
    tokenizer, max_length, --skip-bad), and that command runs and names the dropped record."""
    import shlex

    from hf_stable.cli import main as cli_main
    from hf_stable.config import load_config
    from hf_stable.doctor import run_doctor
    from tests.dist_scripts.harness import tiny_base_args

    rows = [chat(i) for i in range(12)]
    rows[4] = chat(4, answer=" ")
    path = write(tmp_path / "mine.jsonl", rows)
    argv = [*tiny_base_args(tmp_path / "bases"), "--data.train_file", path, "--data.on_bad_record", "skip"]
    report = run_doctor(load_config(argv=argv), dry_run=False)
    fixes = [f.fix for f in report.findings if f.check == "hazards.data_audit" and "dropped" in f.what]
    command = f"hf-stable audit {path} --tokenizer embedded:tiny-llama --max-length 128 --skip-bad"
    assert fixes == [f"inspect it record by record: `{command}`"]
    monkeypatch.setenv("HF_STABLE_CACHE", str(tmp_path / "cache"))
    assert cli_main(shlex.split(command)[1:]) == 0
    assert f"  {path}:5: the last message's content is empty" in capsys.readouterr().out
