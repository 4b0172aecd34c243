"""`stage: grpo` end to end (one short run): the recipe's SFT run, then configs/grpo.yaml started from its output dir
on a tiny base. The adapter moves from the SFT one it continued, the summary carries the stage's numbers, the model
card names the chain."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.test_recipe import ROOT, run_recipe, tiny_overrides

pytestmark = pytest.mark.slow
pytest.importorskip("trl")


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stages")
    sft = tmp_path_factory.mktemp("sft")
    proc = run_recipe(tiny_overrides(sft, "llama", steps=6))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    prompts = (ROOT / "data/embedded/grpo.jsonl").read_text(encoding="utf-8").split("\n")[:24]
    (tmp / "prompts.jsonl").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    args = tiny_overrides(tmp, "llama", steps=3)  # the same tiny base (its cache is shared) and eval file
    args[args.index("--data.train_file") + 1] = str(tmp / "prompts.jsonl")
    args += ["--config", str(ROOT / "configs/grpo.yaml"), "--model.start_from", str(sft / "out")]
    args += ["--grpo.num_generations", "4", "--grpo.max_completion_length", "8", "--training.logging_steps", "1"]
    proc = run_recipe(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return sft / "out", tmp / "out", proc


def test_the_adapter_moved_from_the_sft_adapter_it_continued(stages):
    sft, grpo, _ = stages
    start, end = load_file(sft / "adapter_model.safetensors"), load_file(grpo / "adapter_model.safetensors")
    assert start.keys() == end.keys()
    lora = [k for k in end if "lora_" in k]
    assert lora and all(bool(end[k].isfinite().all()) for k in lora)
    moved = [k for k in lora if not bool((start[k] == end[k]).all())]
    assert len(moved) >= len(lora) // 2, f"only {len(moved)} of {len(lora)} LoRA tensors changed"
    config = json.loads((grpo / "adapter_config.json").read_text())
    assert (
        config["base_model_name_or_path"]
        == json.loads((sft / "adapter_config.json").read_text())["base_model_name_or_path"]
    )


def test_the_summary_has_the_stage_metrics(stages):
    _, grpo, proc = stages
    summary = json.loads((grpo / "run_summary.json").read_text())
    assert summary["stage"] == "grpo" and summary["stage_chain"] == ["sft", "grpo"]
    assert summary["train_steps"] == 3 and [s for s, _ in summary["reward_over_steps"]] == [1, 2, 3]
    assert all(0.0 <= r <= 2.0 for _, r in summary["reward_over_steps"])  # exact_answer + answer_similarity
    assert summary["kl_last"] is not None and summary["kl_last"] >= 0.0  # beta 0.04: TRL logs the KL
    families = summary["exact_match_by_family"]
    assert families["before"] and families["before"].keys() == families["after"].keys()
    assert all(0.0 <= v <= 1.0 for v in (*families["before"].values(), *families["after"].values()))
    assert summary["exact_match_detail"]["before"]["n"] == 8
    assert "exact match per family:" in proc.stdout and "(base → SFT → GRPO)" in proc.stdout
    assert (grpo / "generation_config.json").is_file() and (grpo / "RUN_INCOMPLETE.json").exists() is False


def test_the_model_card_names_the_stage_chain(stages):
    _, grpo, _ = stages
    card = (grpo / "README.md").read_text(encoding="utf-8")
    assert "**Stage chain:** embedded:tiny-llama → SFT → GRPO" in card
    assert card.startswith("---\n") and card.index("Stage chain") > card.index("\n---\n")


def test_a_clean_grpo_stage_says_nothing_alarming(stages):
    """The healthy stage run raises no warning-level event (issue 40: GRPO runs used to open with one)."""
    from hf_stable.core.events import read_events

    _, out, proc = stages
    loud = [(e["step"], e["kind"]) for e in read_events(out) if e.get("severity") in ("warning", "error", "critical")]
    assert loud == []
    assert "[hf_stable] WARNING" not in proc.stdout + proc.stderr  # nor on the console the user reads
