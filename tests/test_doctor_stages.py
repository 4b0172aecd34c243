"""The doctor on `stage: dpo | grpo`: silent on the shipped stage configs, and each stage hazard found: a reference
equal to the policy, beta 0, generation that cannot fit, a reward that cannot be imported or returns the wrong
length; the memory estimate counts the reference and the generation cache; the 8B DPO recipes fit their cards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_stable.config import load_config
from hf_stable.doctor.memory_estimate import GIB, estimate_memory, memory_findings
from hf_stable.doctor.settings import resolve_settings
from hf_stable.doctor.stage_checks import (
    check_generation_lengths,
    check_reference,
    check_rewards,
    stage_findings,
)
from hf_stable.stages.prompts import read_prompts
from tests.test_doctor_memory import _meta

pytest.importorskip("trl")
ROOT = Path(__file__).resolve().parents[1]


def _cfg(name: str, *argv: str):
    return load_config(ROOT / "configs" / f"{name}.yaml", list(argv), check=False)


def _checks(findings) -> list[tuple[str, str]]:
    return [(f.severity, f.check) for f in _ours(findings)]


def _ours(findings) -> list:
    """This module's findings (`hazards.stages.*`); `hf_stable.stages.doctor` adds the start and GRPO prompt rows."""
    return [f for f in findings if f.check.startswith("hazards.stages.")]


def test_reference_checks_are_silent_on_the_shipped_stages_and_fire_on_each_fault():
    assert check_reference(_cfg("dpo")) == [] and check_reference(_cfg("grpo")) == []
    assert _checks(check_reference(_cfg("dpo", "--dpo.beta", "0"))) == [("error", "hazards.stages.beta_zero")]
    policy = check_reference(_cfg("dpo", "--dpo.sync_ref_model", "true", "--dpo.ref_model_mixup_alpha", "1.0"))
    assert _checks(policy) == [("error", "hazards.stages.reference_is_policy")]
    assert "the DPO rewards compare the model with itself" in policy[0].what
    assert check_reference(_cfg("dpo", "--dpo.sync_ref_model", "true")) == []  # TRL's alpha 0.6: a real reference
    off = check_reference(_cfg("grpo", "--grpo.beta", "0", "--grpo.sync_ref_model", "true"))
    assert _checks(off) == [("warning", "hazards.stages.beta_zero_reference")]
    kl = _cfg("grpo", "--grpo.beta", "0.04", "--grpo.sync_ref_model", "true", "--grpo.ref_model_mixup_alpha", "1")
    assert _checks(check_reference(kl)) == [("error", "hazards.stages.reference_is_policy")]


def test_generation_length_fits_or_says_what_cannot_fit():
    cfg = _cfg("grpo")
    assert check_generation_lengths(cfg, [40, 60], max_positions=512) == []
    long = _cfg("grpo", "--grpo.max_completion_length", "600")
    got = check_generation_lengths(long, [40, 60], max_positions=512)
    assert _checks(got) == [
        ("error", "hazards.stages.generation_length"),
        ("warning", "hazards.stages.generation_length"),
    ]
    assert "longest prompt 60 tokens + grpo.max_completion_length 600 = 660" in got[0].evidence
    vllm = _cfg("grpo", "--grpo.use_vllm", "true", "--grpo.vllm_max_model_length", "64")
    assert _checks(check_generation_lengths(vllm, [60], max_positions=None)) == [
        ("error", "hazards.stages.generation_length")
    ]


def test_rewards_are_called_as_trl_calls_them(tmp_path, monkeypatch):
    rows = read_prompts("embedded:grpo")[:2]
    assert check_rewards(_cfg("grpo"), rows) == []  # the shipped rewards on the shipped prompts
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, **kw):\n    return [1.0]\n"
        "def text(completions, **kw):\n    return ['good' for _ in completions]\n"
        "def fine(completions, answer, **kw):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["my_rewards:short", "my_rewards:text", "my_rewards:fine", "no_such_module:f", "my_rewards:missing"]
    got = check_rewards(_cfg("grpo", "--rewards", json.dumps(names)), rows)
    assert _checks(got) == [
        ("error", "hazards.stages.reward_length"),
        ("error", "hazards.stages.reward_length"),
        ("error", "hazards.stages.reward_import"),
        ("error", "hazards.stages.reward_import"),
    ]
    assert "got list of 1 for 2 completions" in got[0].what and "'my_rewards:short'" in got[0].what
    assert "cannot import 'no_such_module'" in got[2].evidence
    sys.modules.pop("my_rewards", None)


def test_stage_findings_audit_the_pairs_with_the_tokenizer(tokenizer, tmp_path):
    cfg = _cfg("dpo")
    got = stage_findings(cfg, tokenizer)
    assert [f.what for f in _ours(got)] == [
        "data.train_file: 1000 preference pairs kept of 1000",
        "data.eval_file: 200 preference pairs kept of 200",
    ]
    grpo = _cfg("grpo", "--grpo.max_completion_length", "600")
    got = _ours(stage_findings(grpo, tokenizer, _meta_tiny()))  # prompts rendered and counted, positions read
    assert _checks(got) == [("error", "hazards.stages.generation_length")]
    assert "generation cannot fit the model's 512 positions" in got[0].what
    assert _ours(stage_findings(_cfg("grpo"), tokenizer, _meta_tiny())) == []  # the shipped GRPO config: silent
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "x", "chosen": "a", "rejected": "a"}\n')
    got = stage_findings(_cfg("dpo", "--data.train_file", str(bad), "--data.eval_file", "null"), None)
    assert _checks(got) == [("error", "hazards.stages.data")] and f"{bad}:1: " in got[0].evidence


def test_memory_counts_the_reference_copy_both_dpo_rows_and_the_generation_cache():
    model = _meta("llama")
    sft = _cfg("llama3.1-8b-lora", "--data.max_length", "2048", "--training.per_device_train_batch_size", "4")
    dpo = _cfg("llama3.1-8b-dpo")
    est = {c.stage: estimate_memory(model, c, resolve_settings(c, None), meta=True) for c in (sft, dpo)}
    assert est["dpo"].parts["reference adapter copy"] == est["dpo"].parts["trainable weights"]
    assert "reference adapter copy" not in est["sft"].parts
    assert est["dpo"].parts["activations"] == pytest.approx(2 * est["sft"].parts["activations"], rel=0.01)
    grpo = _cfg("grpo")
    s = resolve_settings(grpo, None)
    tiny = _meta_tiny()
    cache = estimate_memory(tiny, grpo, s, meta=True).parts["generation KV cache"]
    completion = 16  # configs/grpo.yaml
    assert cache == 2 * 2 * 2 * 16 * (grpo.data.max_length + completion) * s.micro_batch * 4  # K,V x layers x kv x d


def _meta_tiny():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("recipe", "budget"), [("llama3.1-8b-dpo", 80), ("llama3.1-8b-qlora-dpo", 24)])
def test_the_8b_dpo_recipes_fit_their_cards(recipe, budget):
    from hf_stable.doctor.settings import doctor_settings

    cfg = _cfg(recipe)
    s = resolve_settings(cfg, None, remove_unused_columns=False)
    (finding,) = memory_findings(cfg, s, doctor_settings(cfg), meta_model=_meta("llama"))
    assert finding.severity == "info" and f"fits {budget * 0.9:.2f} GiB" in finding.what
    quoted = {"llama3.1-8b-dpo": 49.95, "llama3.1-8b-qlora-dpo": 17.57}[recipe]  # the header's number
    assert f"estimated training memory {quoted:.2f} GiB" in finding.what
    assert estimate_memory(_meta("llama"), cfg, s, meta=True).total < budget * 0.9 * GIB
