"""How the recipe hands its optimizer to the Trainer: prebuilt where the Trainer trains it, a factory under DeepSpeed
(which drops a prebuilt optimizer) and FSDP (which refuses one), with the same groups either way.

The engines themselves run in tests/test_distributed_engines.py (the Trainer's groups under ZeRO-2/3 and FSDP2 equal
`optimizer_groups.json`); here the choice and the factory's groups, in one process.
"""

from __future__ import annotations

import pytest
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

from hf_stable.config import OptimConfig, RunConfig
from hf_stable.optim import (
    PhasedOptimizer,
    build_optimizer,
    engine_builds_optimizer,
    group_table,
    trainer_optimizer_arguments,
)
from tests.helpers import make_tiny_model

ENGINE_ENV = {"DeepSpeed": "ACCELERATE_USE_DEEPSPEED", "FSDP": "ACCELERATE_USE_FSDP"}


def _setup(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(str(tmp_path), learning_rate=1e-3, report_to=[], use_cpu=True, max_steps=1)
    return model, args


def test_a_plain_run_gets_the_prebuilt_optimizer(tokenizer, tmp_path, monkeypatch):
    for name in ENGINE_ENV.values():
        monkeypatch.delenv(name, raising=False)
    model, args = _setup(tokenizer, tmp_path)
    optimizer = build_optimizer(model, OptimConfig(), args)
    assert engine_builds_optimizer(args) is None
    assert trainer_optimizer_arguments(optimizer, OptimConfig(), args) == {"optimizers": (optimizer, None)}


@pytest.mark.parametrize("engine", sorted(ENGINE_ENV))
@pytest.mark.parametrize("phases", [False, True])
def test_under_deepspeed_and_fsdp_the_trainer_builds_the_same_groups(tokenizer, tmp_path, monkeypatch, engine, phases):
    """`accelerate launch` with a DeepSpeed / FSDP config says so in the environment; the Trainer then gets a factory
    whose optimizer has the prebuilt one's table (names, layer-wise LRs, LoRA+, decay), phases included."""
    model, args = _setup(tokenizer, tmp_path)
    cfg = RunConfig()
    cfg.stability.guards.phases.enabled = phases
    optimizer = build_optimizer(model, cfg.optim, args)
    with monkeypatch.context() as env:
        env.setenv(ENGINE_ENV[engine], "true")
        assert engine_builds_optimizer(args) == engine
        kwargs = trainer_optimizer_arguments(optimizer, cfg.optim, args, phases=cfg.stability.guards.phases)
    assert set(kwargs) == {"optimizer_cls_and_kwargs"}  # never optimizers=: DeepSpeed drops it, FSDP refuses it
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4, "labels": [[1, 2, 3, 4]] * 4})
    trainer = Trainer(model=model, args=args, train_dataset=data, **kwargs)
    built = trainer.create_optimizer()
    assert built is not optimizer and isinstance(built, PhasedOptimizer) == phases

    def groups(opt):  # the table without the class that runs (the factory's optimizer is wrapped for the phases)
        return [{k: v for k, v in row.items() if k != "optimizer"} for row in group_table(opt)]

    assert groups(built) == groups(optimizer)
    assert ("phases:" in group_table(built)[0]["optimizer"]) == phases
    lrs = {row["name"]: row["lr"] for row in group_table(built)}
    assert lrs["layer_1.lora_B"] == pytest.approx(16 * lrs["layer_1.lora_A"])  # LoRA+ (default ratio 16)
