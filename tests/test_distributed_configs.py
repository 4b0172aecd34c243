"""configs/accelerate and configs/deepspeed are valid for the tools that read them, and the distributed helpers
behave in a single process. FSDP cannot run on CPU (accelerate turns it into DDP), so the FSDP2 config is
checked through accelerate's own launch → plugin → auto-wrap path on the tiny Llama / Qwen2 / Qwen3 models."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_stable.config.loader import build_section
from hf_stable.config.runtime import RuntimeConfig
from hf_stable.distributed import (
    all_gather_tensor,
    all_reduce_flag,
    all_reduce_scalar,
    all_reduce_tensor,
    barrier,
    broadcast_object,
    prepare_launch,
)
from hf_stable.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = ROOT / "configs" / "accelerate"
EXPECTED = {
    "single-gpu",
    "multi-gpu-ddp",
    "deepspeed-zero2",
    "deepspeed-zero2-offload",
    "deepspeed-zero3",
    "fsdp2",
    "two-node",
    "cpu-2proc",
}
KEY_LINE = re.compile(r"^\s*[A-Za-z0-9_]+:")


def _configs() -> list[Path]:
    return sorted(ACCELERATE.glob("*.yaml"))


def test_every_accelerate_config_exists_says_how_to_launch_and_comments_every_key():
    assert {p.stem for p in _configs()} == EXPECTED
    for path in _configs():
        lines = path.read_text().splitlines()
        header = "\n".join(line for line in lines[:14] if line.startswith("#"))
        assert lines[0].startswith("# ") and f"--config_file configs/accelerate/{path.name}" in header, path.name
        uncommented = [line for line in lines if KEY_LINE.match(line) and "#" not in line]
        assert not uncommented, f"{path.name}: keys without a comment: {uncommented}"


def test_accelerate_parses_every_config_and_precision_is_left_to_the_recipe():
    from accelerate.commands.config.config_args import load_config_from_file

    for path in _configs():
        cfg = load_config_from_file(str(path))
        assert cfg.num_processes >= 1 and cfg.compute_environment.value == "LOCAL_MACHINE"
        # one precision switch: the recipe's training.bf16 / fp16 (absent for DeepSpeed, where accelerate forbids it)
        assert str(cfg.mixed_precision) in ("None", "no", "PrecisionType.NO"), path.name
        ds_file = (cfg.deepspeed_config or {}).get("deepspeed_config_file")
        if cfg.distributed_type.value == "DEEPSPEED":
            assert ds_file and (ROOT / ds_file).is_file(), path.name
    assert load_config_from_file(str(ACCELERATE / "two-node.yaml")).num_machines == 2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fsdp2_config_wraps_exactly_the_decoder_layers(arch, tokenizer, monkeypatch):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.launch import prepare_multi_gpu_env
    from peft import LoraConfig, get_peft_model

    from tests.helpers import make_tiny_model

    parsed = launch_command_parser().parse_args(["--config_file", str(ACCELERATE / "fsdp2.yaml"), "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(parsed)[0])  # what `accelerate launch` exports
    for key, value in env.items():
        if key.startswith("FSDP_") or key == "ACCELERATE_USE_FSDP":
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and "FULL_STATE_DICT" in str(plugin.state_dict_type)
    model = get_peft_model(make_tiny_model(arch, tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [type(m).__name__ for m in model.modules() if policy(m)]
    expected = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer"}[arch]
    assert wrapped == [expected] * model.config.num_hidden_layers


@pytest.mark.deepspeed
@pytest.mark.parametrize("name,stage", [("zero2", 2), ("zero2-offload", 2), ("zero3", 3)])
def test_deepspeed_json_is_accepted_by_transformers_and_deepspeed(name, stage, tokenizer, tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    from tests.helpers import make_tiny_model

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        report_to="none",
    )
    model = make_tiny_model("llama", tokenizer)  # before the DeepSpeed config exists: no zero.Init here
    hf_cfg = HfTrainerDeepSpeedConfig(str(ROOT / "configs" / "deepspeed" / f"{name}.json"))
    try:
        hf_cfg.trainer_config_process(args)
        hf_cfg.trainer_config_finalize(args, model, num_training_steps=100)
        filled = hf_cfg.config
    finally:
        unset_hf_deepspeed_config()  # the config registers itself globally; later tests must not see ZeRO-3
    assert '"auto"' not in json.dumps(filled)  # every "auto" was filled from the recipe's training section
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_clipping"]) == (4, 0.5)
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False
    ds = DeepSpeedConfig(filled)  # DeepSpeed's own schema rejects unknown or misspelled keys
    assert ds.zero_optimization_stage == stage
    if name == "zero3":
        assert ds.zero_config.gather_16bit_weights_on_model_save is True
    if name == "zero2-offload":
        assert ds.zero_config.offload_optimizer.device == "cpu" and filled["zero_force_ds_cpu_optimizer"] is False


def test_collectives_are_identity_in_a_single_process():
    assert all_reduce_flag(True) is True and all_reduce_flag(False, require="all") is False
    assert all_reduce_scalar(2.5, "mean") == 2.5 and all_reduce_scalar(3, "max") == 3.0
    assert broadcast_object({"a": 1}) == {"a": 1}
    barrier()
    with pytest.raises(ValueError, match="op: got 'avg'"):
        all_reduce_scalar(1.0, "avg")
    t = torch.tensor([1.0, 2.0])
    assert all_reduce_tensor(t, "max") is t and t.tolist() == [1.0, 2.0]
    assert all_gather_tensor(t).shape == (1, 2)
    with pytest.raises(ValueError, match="op: got 'prod'"):
        all_reduce_tensor(t, "prod")


def test_settle_waits_until_nothing_else_holds_a_collectives_tensor():
    """What keeps a gloo worker from freeing a Python-owned tensor during interpreter shutdown (SIGABRT): the
    tensor stays tracked while anything besides us holds it, here a view standing in for the backend's work."""
    from hf_stable import distributed

    tensor = torch.zeros(2)
    held = tensor.view(-1)  # a second owner of the TensorImpl, as gloo's finished AsyncWork is
    distributed._track(tensor)
    del tensor
    assert not distributed.settle(timeout=0.05) and len(distributed._IN_FLIGHT) == 1
    del held
    assert distributed.settle(timeout=1.0) and distributed._IN_FLIGHT == []


def test_prepare_launch_refuses_ranks_that_would_each_train_alone(monkeypatch):
    from transformers.training_args import ParallelMode

    alone = SimpleNamespace(world_size=1, parallel_mode=ParallelMode.NOT_PARALLEL, deepspeed=None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"training.use_cpu: the launcher started 2 processes .*use_cpu true"):
        prepare_launch(alone)
    prepare_launch(SimpleNamespace(world_size=2, parallel_mode=ParallelMode.DISTRIBUTED, deepspeed=None))
    monkeypatch.setenv("WORLD_SIZE", "1")
    prepare_launch(alone)


def test_runtime_config_validation_names_the_fields():
    problems: list[str] = []
    data = {"resume": "auto", "preemption": {"signals": ["SIGTERM", "SIGKILL"]}}
    cfg = build_section(RuntimeConfig, data, "runtime", problems)
    allowed = "SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP"
    assert problems == [f"runtime.preemption.signals: got ['SIGKILL'], allowed: {allowed}"]
    problems = []
    build_section(RuntimeConfig, {"resume": " ", "preemption": {"exit_code": 300}}, "runtime", problems)
    assert problems == [
        "runtime.preemption.exit_code: got 300, must be in [0, 255]",
        "runtime.resume: got '', must be 'auto', 'never' or a checkpoint path",
    ]
    assert cfg.preemption.exit_code == 143 and cfg.resume == "auto"
