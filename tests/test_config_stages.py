"""`stage: sft | dpo | grpo` and the `dpo:` / `grpo:` sections: TRL's field names checked against TRL's own config
dataclasses (did-you-mean), TrainingArguments fields and TRL's `max_length` refused with the key to use instead,
`model.start_from` resolved to an adapter or a merged export, and the values passed through to TRL's config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_stable.config import config_from_dict, load_config
from hf_stable.config.stages import stage_arguments
from hf_stable.errors import ConfigError, MissingDependencyError
from hf_stable.stages import run_stage
from hf_stable.stages.common import chain_text, stage_chain
from hf_stable.stages.start import resolve_start_from

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]


def _problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return info.value.problems


def test_the_default_is_sft_and_needs_no_stage_section():
    cfg = load_config()
    assert cfg.stage == "sft" and cfg.dpo == {} and cfg.grpo == {} and cfg.model.start_from is None


def test_a_grpo_section_takes_trl_names_and_coerces_numbers():
    cfg = config_from_dict({"stage": "grpo", "grpo": {"num_generations": 4, "beta": "1e-3", "temperature": 1}})
    assert cfg.grpo == {"num_generations": 4, "beta": 0.001, "temperature": 1.0}
    assert isinstance(cfg.grpo["temperature"], float)


def test_a_misspelt_trl_key_gets_did_you_mean():
    (problem,) = _problems({"stage": "grpo", "grpo": {"num_generation": 4}})
    assert problem.startswith("grpo.num_generation: not a trl.GRPOConfig field")
    assert "num_generations" in problem
    (problem,) = _problems({"stage": "dpo", "dpo": {"betta": 0.1}})
    assert "trl.DPOConfig" in problem and "beta" in problem


def test_training_arguments_fields_belong_under_training():
    problems = _problems({"stage": "grpo", "grpo": {"learning_rate": 1e-5, "per_device_train_batch_size": 4}})
    assert problems == [
        "grpo.learning_rate: a TrainingArguments field, set it as training.learning_rate (every stage reads it)",
        (
            "grpo.per_device_train_batch_size: a TrainingArguments field, set it as "
            "training.per_device_train_batch_size (every stage reads it)"
        ),
    ]


def test_trl_max_length_is_refused_for_data_max_length():
    (problem,) = _problems({"stage": "dpo", "dpo": {"max_length": 512}})
    assert problem == "dpo.max_length: set by the recipe, use data.max_length instead"
    (problem,) = _problems({"stage": "grpo", "grpo": {"model_init_kwargs": {"dtype": "bfloat16"}}})
    assert problem.startswith("grpo.model_init_kwargs: set by the recipe, use model.")


def test_a_section_for_another_stage_and_start_from_on_sft_are_refused():
    problems = _problems({"grpo": {"num_generations": 4}, "model": {"start_from": "outputs/default"}})
    assert problems[0].startswith("grpo: set but stage is 'sft'")
    assert problems[1].startswith("model.start_from: only for stage dpo or grpo")
    assert _problems({"stage": "ppo"})[0].startswith("stage: got 'ppo', allowed: one of 'sft', 'dpo', 'grpo'")


def test_dpo_max_length_is_data_max_length_and_grpo_values_reach_trl(tmp_path):
    cfg = config_from_dict(
        {
            "stage": "dpo",
            "data": {"max_length": 96},
            "dpo": {"beta": 0.25},
            "training": {"output_dir": str(tmp_path), "learning_rate": 5e-5, "use_cpu": True},
        }
    )
    args = stage_arguments(cfg)
    assert type(args).__name__ == "DPOConfig"
    assert (args.max_length, args.beta, args.learning_rate) == (96, 0.25, 5e-5)


def test_use_vllm_is_passed_through_to_grpo_config(tmp_path):
    cfg = config_from_dict(
        {
            "stage": "grpo",
            "grpo": {"use_vllm": True, "vllm_mode": "colocate", "num_generations": 4, "max_completion_length": 32},
            "training": {"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "use_cpu": True},
        }
    )
    assert cfg.grpo["use_vllm"] is True
    args = stage_arguments(cfg)
    assert type(args).__name__ == "GRPOConfig"
    assert (args.use_vllm, args.vllm_mode, args.num_generations, args.max_completion_length) == (
        True,
        "colocate",
        4,
        32,
    )


def test_start_from_an_sft_run_dir_is_its_adapter(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    (run / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/bases/tiny"}))
    start = resolve_start_from(str(run))
    assert (start.kind, start.path, start.adapter_base, start.chain) == ("adapter", run, "/bases/tiny", ["sft"])
    assert stage_chain(start, "grpo") == ["sft", "grpo"]
    assert chain_text(stage_chain(start, "grpo"), "embedded:tiny-llama") == "embedded:tiny-llama → SFT → GRPO"


def test_start_from_a_merged_export_and_an_earlier_stage_chain(tmp_path):
    merged = tmp_path / "dpo" / "merged"
    merged.mkdir(parents=True)
    (merged / "config.json").write_text("{}")
    (merged / "model.safetensors").write_bytes(b"")
    (tmp_path / "dpo" / "run_summary.json").write_text(json.dumps({"stage_chain": ["sft", "dpo"]}))
    start = resolve_start_from(str(merged))
    assert (start.kind, start.chain) == ("merged", ["sft", "dpo"])
    assert chain_text(stage_chain(start, "grpo")) == "base → SFT → DPO → GRPO"


def test_start_from_that_holds_no_model_says_what_it_needs(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        resolve_start_from(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")  # a config without weights: not a checkpoint
    with pytest.raises(ConfigError, match="neither a LoRA adapter .* nor a merged checkpoint"):
        resolve_start_from(str(tmp_path))


def test_without_trl_a_stage_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError, as when it is not installed
    problems = _problems({"stage": "grpo"})
    assert problems == ["stage: grpo needs TRL, which is not installed: pip install 'hf_stable[trl]'"]
    cfg = config_from_dict({})  # SFT never imports TRL
    cfg.stage = "dpo"
    with pytest.raises(MissingDependencyError, match=r"pip install 'hf_stable\[trl\]'"):
        run_stage(cfg)


def test_run_stage_leaves_sft_to_the_recipe():
    with pytest.raises(ValueError, match="scripts/finetune.py"):
        run_stage(config_from_dict({}))


def test_bf16_and_checkpointing_keep_training_arguments_defaults_unless_set(tmp_path):
    base = {"stage": "grpo", "grpo": {"num_generations": 2}}
    training = {"output_dir": str(tmp_path), "per_device_train_batch_size": 2, "use_cpu": True}
    args = stage_arguments(config_from_dict({**base, "training": training}))
    assert (args.bf16, args.activation_checkpointing, args.gradient_checkpointing) == (False, False, False)
    on = {**training, "activation_checkpointing": True}
    args = stage_arguments(config_from_dict({**base, "training": on}))
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True


def test_the_7b_grpo_config_fits_one_gpu_without_vllm_and_passes_use_vllm():
    cfg = load_config(ROOT / "configs/qwen2.5-7b-grpo.yaml")
    args = stage_arguments(cfg, use_cpu=True)
    assert cfg.stage == "grpo" and cfg.model.start_from == "outputs/qwen2.5-7b-lora" and cfg.lora.enabled
    assert (args.bf16, args.activation_checkpointing, args.use_vllm) == (True, True, False)
    assert args.max_completion_length <= cfg.data.max_length and args.num_generations == 8
    on = load_config(ROOT / "configs/qwen2.5-7b-grpo.yaml", ["--grpo.use_vllm", "true"])
    assert stage_arguments(on, use_cpu=True).use_vllm is True
