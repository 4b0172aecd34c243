"""The GRPO stage's rewards (`hf_stable.rewards`) on the embedded prompts, `module:function` rewards, and the
`embedded:grpo` prompts themselves (deterministic, held out from the eval set, with the fields the rewards read)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_stable.config import config_from_dict
from hf_stable.embedded.tasks import GRPO_FAMILIES, grpo_prompts, instruction_dataset
from hf_stable.errors import ConfigError
from hf_stable.resources import data_file
from hf_stable.rewards import answer_format, answer_similarity, exact_answer, resolve_reward, resolve_rewards

ROOT = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in data_file("embedded:grpo").read_text(encoding="utf-8").splitlines()]


def _columns(rows):
    return {"answer": [r["answer"] for r in rows], "family": [r["family"] for r in rows]}


def test_embedded_grpo_prompts_are_the_generator_s_held_out_balanced_and_answered():
    assert ROWS == grpo_prompts(0)  # scripts/make_dataset.py's default seed, byte for byte the same records
    _, eval_rows = instruction_dataset(0, n_train=0, n_eval=200)
    held_out = {(r["instruction"], r["input"]) for r in eval_rows}
    assert not held_out & {(r["instruction"], r["input"]) for r in ROWS}
    assert {f: sum(r["family"] == f for r in ROWS) for f in GRPO_FAMILIES} == dict.fromkeys(GRPO_FAMILIES, 200)
    assert all(r["answer"] and r["answer"] == r["answer"].strip() for r in ROWS)


def test_exact_answer_scores_the_answers_themselves_and_nothing_else():
    cols = _columns(ROWS)
    assert exact_answer([f"  {a}\n" for a in cols["answer"]], **cols) == [1.0] * len(ROWS)
    wrong = [a + "0" for a in cols["answer"]]
    assert exact_answer(wrong, **cols) == [0.0] * len(ROWS)
    chat = [[{"role": "assistant", "content": "107"}]]  # conversational completions: the message's text
    assert exact_answer(chat, answer=["107"]) == [1.0]


def test_answer_format_knows_each_family_s_shape():
    rows = {f: next(r for r in ROWS if r["family"] == f and r["lang"] == "en") for f in GRPO_FAMILIES}
    arith, rev, unit = rows["arithmetic"], rows["reversal"], rows["unit_conversion"]
    unit_word = unit["answer"].split()[1]
    cases = [
        (arith, "12", 1.0),
        (arith, "twelve", 0.0),
        (arith, "12\n13", 0.0),
        (rev, "x" * len(rev["answer"]), 1.0),
        (rev, "x" * (len(rev["answer"]) + 1), 0.0),
        (unit, f"5 {unit_word}", 1.0),
        (unit, "5", 0.0),
        (unit, f"5 {unit_word}s", 0.0),
    ]
    got = [answer_format([text], answer=[r["answer"]], family=[r["family"]])[0] for r, text, _ in cases]
    assert got == [want for _, _, want in cases]


def test_answer_similarity_gives_partial_credit_in_order():
    sim = answer_similarity(
        ["107", "108", "150", "abc", "27000 米", "27100 米", "27000 m", "foctibbar", "foctibbra", "zzz"],
        answer=["107", "107", "107", "107", "27000 米", "27000 米", "27000 米", "foctibbar", "foctibbar", "foctibbar"],
    )
    assert sim[0] == sim[4] == sim[7] == 1.0
    assert 1.0 > sim[1] > sim[2] > sim[3] == 0.0  # closer numbers earn more; no number, nothing
    assert 1.0 > sim[5] > sim[6] > 0.0  # a near number in the right unit beats the right number in the wrong unit
    assert 1.0 > sim[8] > sim[9]
    assert all(0.0 <= s <= 1.0 for s in sim)


def test_a_user_reward_is_imported_from_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, **kw):\n    return [-len(c) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("my_rewards:short")
    assert fn(["ab", "abcd"]) == [-2, -4]
    with pytest.raises(ConfigError) as info:
        resolve_rewards(["no_such_module_44:f", "my_rewards:missing", "exact_answr"])
    assert info.value.problems == [
        (
            "rewards: cannot import 'no_such_module_44' for 'no_such_module_44:f': ModuleNotFoundError: "
            "No module named 'no_such_module_44'"
        ),
        "rewards: 'my_rewards' has no attribute 'missing' (for 'my_rewards:missing')",
        (
            "rewards: unknown reward 'exact_answr' (shipped: exact_answer, answer_format, answer_similarity; "
            "your own: 'module:function')"
        ),
    ]


def test_an_unknown_shipped_reward_is_refused_when_the_config_loads():
    pytest.importorskip("trl")
    with pytest.raises(ConfigError) as info:
        config_from_dict({"stage": "grpo", "rewards": ["exact_anwser"]})
    assert info.value.problems[0].startswith("rewards: unknown reward 'exact_anwser' (did you mean exact_answer?")


def test_the_doctor_checks_a_grpo_stage_s_start_prompts_rewards_and_lengths(tmp_path, monkeypatch, tokenizer):
    pytest.importorskip("trl")
    from hf_stable.config import load_config
    from hf_stable.stages.doctor import stage_findings

    run = tmp_path / "sft"
    run.mkdir()
    (run / "adapter_config.json").write_text("{}")
    grpo = load_config(ROOT / "configs/grpo.yaml", ["--model.start_from", str(run)])
    clean = stage_findings(grpo, tokenizer)
    assert [f.severity for f in clean if f.severity in ("warning", "error")] == []
    assert any(f.check == "hazards.stage.prompts" and f.what.startswith("600 prompts") for f in clean)

    (tmp_path / "bad_rewards.py").write_text("def one(completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--model.start_from", str(tmp_path / "none"), "--rewards", "[bad_rewards:one]", "--data.max_length", "16"]
    faulty = {f.check: f for f in stage_findings(load_config(ROOT / "configs/grpo.yaml", argv), tokenizer)}
    assert faulty["hazards.stage.start"].severity == "error"
    assert (
        faulty["hazards.stage.rewards"].what
        == "reward bad_rewards:one returns 1 values for 4 completions (or a non-finite one)"
    )
    assert faulty["hazards.stage.lengths"].severity == "warning"
