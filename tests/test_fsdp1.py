"""FSDP1 is refused before the first step, with one message naming `fsdp_version: 2` and where to set it.

accelerate 1.15 refuses FSDP1 on CPU ranks itself (its plugin's `sync_module_states` needs a GPU-like device), so
the refusal is what runs here: from `TrainingArguments`, from a launch config's environment, from accelerate's plugin
(a real `FullyShardedDataParallelPlugin`), and from a model really wrapped by torch's FSDP1 on 2 gloo ranks, whose
gradients are each rank's flat shard - the numbers hf_stable's callbacks must never clip or skip on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from accelerate.utils import FullyShardedDataParallelPlugin

from hf_stable.callbacks import build_callbacks
from hf_stable.config import load_config
from hf_stable.core.engine import fsdp1_source
from hf_stable.errors import ConfigError
from hf_stable.trainer import StableTrainer
from tests.dist_scripts.guards_common import tiny_lora_llama, token_data, training_args
from tests.dist_scripts.harness import ROOT, tiny_base_args, torchrun_two_ranks


def _fsdp_args(tmp_path, version: int):
    config = {"fsdp_version": version, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    return training_args(tmp_path, fsdp="full_shard", fsdp_config=config)


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("ACCELERATE_USE_FSDP", "FSDP_VERSION"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_fsdp1_in_training_arguments_is_refused_before_accelerate_builds_it(tmp_path, clean_env):
    args = _fsdp_args(tmp_path, 1)
    with pytest.raises(ConfigError) as built:
        build_callbacks(load_config(argv=[]), args)  # a stock Trainer script builds these first
    message = str(built.value)
    assert "TrainingArguments.fsdp_config has fsdp_version 1" in message
    assert "fsdp_version: 2" in message and "training.fsdp_config" in message
    with pytest.raises(ConfigError):  # not accelerate's "no available devices" RuntimeError
        StableTrainer(model=tiny_lora_llama(), args=args, train_dataset=token_data(8))
    assert fsdp1_source(_fsdp_args(tmp_path, 2)) is None  # FSDP2 (also TrainingArguments' default) goes on
    assert fsdp1_source(training_args(tmp_path)) is None


_STOCK_SCRIPT = """
from hf_stable.callbacks import build_callbacks
from hf_stable.config import load_config
from hf_stable.errors import ConfigError
from tests.dist_scripts.guards_common import training_args
try:
    build_callbacks(load_config(argv=[]), training_args({out!r}))
except ConfigError as e:
    print(e)
"""


@pytest.mark.parametrize("version", [None, "2"])
def test_fsdp1_from_a_launch_config_environment_names_the_config_file_line(tmp_path, version):
    """`accelerate launch --config_file` with FSDP and no `fsdp_version` exports ACCELERATE_USE_FSDP alone: a stock
    script (a fresh process, no Accelerator yet) is stopped at `build_callbacks`; FSDP_VERSION=2 goes on."""
    env = {k: v for k, v in os.environ.items() if k not in ("FSDP_VERSION",)}
    env.update(ACCELERATE_USE_FSDP="true", PYTHONPATH=str(ROOT), **({"FSDP_VERSION": version} if version else {}))
    code = _STOCK_SCRIPT.format(out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    if version == "2":
        assert proc.stdout == ""
    else:
        assert "FSDP_VERSION unset, which means 1" in proc.stdout and "--config_file" in proc.stdout
        assert "`fsdp_version: 2` under `fsdp_config:`" in proc.stdout


def test_accelerate_fsdp_plugin_version_decides():
    v1 = FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=False)  # what a config without a version
    assert "accelerate's FSDP plugin has fsdp_version 1" in fsdp1_source(plugin=v1)  # gives (on a GPU)
    assert fsdp1_source(plugin=FullyShardedDataParallelPlugin(fsdp_version=2)) is None


@pytest.mark.slow
def test_the_recipe_stops_on_fsdp1_with_one_message(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts/finetune.py"), "--training.output_dir", str(tmp_path / "out")]
    cmd += ["--training.fsdp", "full_shard", "--training.fsdp_config", "{fsdp_version: 1}"]
    cmd += ["--model.name_or_path", "embedded:tiny-llama", *tiny_base_args(tmp_path / "bases")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("1 configuration problem(s)") == 1 and "Traceback" not in proc.stderr
    assert "TrainingArguments.fsdp_config has fsdp_version 1" in proc.stderr and "fsdp_version: 2" in proc.stderr
    assert "trainable of" not in proc.stdout + proc.stderr  # stopped before the model is loaded


@pytest.mark.slow
@pytest.mark.distributed
def test_an_fsdp1_wrapped_model_is_refused_by_the_engine_seam_and_every_callback(tmp_path):
    torchrun_two_ranks(ROOT / "tests/dist_scripts/fsdp1_refusal.py", str(tmp_path), timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for case, want in (("use_orig_params=True", "FullyShardedDataParallel"), ("use_orig_params=False", "Flat")):
        r0, r1 = ranks[0][case], ranks[1][case]
        # what a DDP reading would take for the global norm: each rank's own shard, different on each rank
        assert r0["local_grad_sq"] != r1["local_grad_sq"]
        for r in (r0, r1):
            assert "FullyShardedDataParallel" in r["engine"] and "fsdp_version: 2" in r["engine"]
            assert r["on_train_begin"] and all(m is not None and "fsdp_version: 2" in m for m in r["on_train_begin"])
        assert r0["flat_params"] == (want == "Flat")
