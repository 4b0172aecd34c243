"""The default recipe, as shipped, under DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 on two CPU ranks (gloo).

Evaluation before and after training (eval loss and greedy exact match) stays on, as in `configs/default.yaml`:
it used to stop ZeRO-2 before the first step and leave ZeRO-3 without a training engine, and FSDP refused the
recipe's optimizer. Each engine is launched once (`harness.engine_runs`, 4 steps, checkpoints every 2); ZeRO-3 and
FSDP2 are preempted (SIGTERM on rank 0 only, after step 2) and rerun, so saving, preemption and resume are covered
on a sharded engine of each kind. The ZeRO-2 / ZeRO-3 runs are also read by tests/test_distributed.py.

FSDP2 is launched as the README says, `accelerate launch --config_file configs/accelerate/fsdp2.yaml` (2 processes),
and runs on CPU through `tests/dist_scripts/fsdp_cpu.py`, a test-only patch that lets accelerate's state say FSDP on
MULTI_CPU (never part of the package). What these tests exercise of accelerate's FSDP path: the config file's
environment (`ACCELERATE_USE_FSDP`, `FSDP_*`) turned into the plugin, the Trainer's FSDP2 branch (the optimizer from
`optimizer_cls_and_kwargs` before sharding), `cpu_ram_efficient_loading` (rank 1 loads the base on the meta device and
gets the weights broadcast from rank 0), `fsdp2_prepare_model` (`fully_shard` per decoder layer from the model's
`_no_split_modules`, then the root; the optimizer moved onto the DTensor shards), gradient clipping over DTensors,
FULL_STATE_DICT gathering in `save_model` and in checkpoints (`pytorch_model_fsdp.bin`, `optimizer.bin`), FSDP
checkpoint loading on resume, and `generate` under FSDP2 (`register_fsdp_forward_method`). Only a GPU run exercises
NCCL, the mixed-precision policies (bf16 parameters / fp32 reduce), parameter CPU offload, FSDP activation
checkpointing and the overlap of communication with compute. (`--training.fsdp full_shard --training.fsdp_config
'{fsdp_version: 2, ...}'` takes the same path from TrainingArguments instead of the environment.)

What the monitors and guards decide under these engines is tests/test_engines.py's business; nothing here asserts
on it (they run here as the default recipe runs them).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_stable.checkpoints import checkpoint_problems
from tests.dist_scripts.harness import (
    CPU,
    ENGINES,
    PREEMPTED_ENGINES,
    engine_runs,
    launch,
    load_adapter,
    recipe_args,
    tiny_base_args,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1200)]


def _engine_param(engine: str):
    marks = [pytest.mark.deepspeed] if engine.startswith("zero") else []
    return pytest.param(engine, marks=marks, id=engine)


ALL = [_engine_param(e) for e in ENGINES]
PREEMPTED = [_engine_param(e) for e in PREEMPTED_ENGINES]


@pytest.fixture
def runs(engine):
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    launches = engine_runs(engine)
    assert launches[-1].returncode == 0, launches[-1].tail()
    return launches


def _summary(run) -> dict:
    return json.loads((run.out / "run_summary.json").read_text())


def _peft_names(tensors: dict) -> dict:
    return {k.replace(".default", ""): v for k, v in tensors.items()}


@pytest.mark.parametrize("engine", ALL)
def test_default_recipe_evaluates_before_and_after_and_trains(engine, runs):
    final = runs[-1]
    summary = _summary(final)
    before, after = summary["eval_loss_before"], summary["eval_loss_after"]
    assert math.isfinite(before) and math.isfinite(after) and after < before - 0.05, summary
    # exact match ran (under ZeRO-3 / FSDP2 on every rank in step), scored on the 16 held-out prompts
    for when in ("before", "after"):
        assert isinstance(summary[f"exact_match_{when}"], float), summary
        assert summary["exact_match_detail"][when]["n"] == 16
    assert summary["train_steps"] == 4 and not (final.out / "RUN_INCOMPLETE.json").exists()
    card = (final.out / "README.md").read_text()
    assert f"{before:.4f}" in card and f"{after:.4f}" in card  # the model card shows both


@pytest.mark.parametrize("engine", ALL)
def test_engine_really_shards(engine, runs):
    r0 = runs[-1].ranks()[0]
    assert r0["world_size"] == 2
    if engine == "fsdp2":  # not the silent DDP fallback accelerate takes on CPU without the test patch
        assert r0["distributed_type"] == "DistributedType.FSDP" and r0["params_dtensor"]
    else:
        assert r0["deepspeed_stage"] == int(engine[-1]) and r0["params_partitioned"] == (engine == "zero3")


@pytest.mark.parametrize("engine", ALL)
def test_replica_check_compares_replicated_weights_and_is_off_where_they_are_sharded(engine, runs):
    for rank in runs[-1].ranks():
        check = rank["callbacks"]["ReplicaCheck"]
        if engine == "zero2":  # the model's weights are whole on every rank: checked at train start, and agreed
            assert check["state"] == {"last_agreed": 0, "checks": 1} and not check["events"]
        else:  # ZeRO-3 / FSDP2 (the resumed launch): said once, never compared
            assert [e["kind"] for e in check["events"]] == ["monitor_off"] and check["state"]["checks"] == 0
            assert "no replicas to compare" in check["events"][0]["message"]


@pytest.mark.parametrize("engine", ALL)
def test_optimizer_groups_reach_the_engine_intact(engine, runs):
    """The Trainer's optimizer under the engine has the recipe's groups (optimizer_groups.json, built on the
    unsharded model as a plain run builds it): names, layer-wise LRs, LoRA+ and weight decay."""
    out = runs[-1].out
    table = json.loads((out / "optimizer_groups.json").read_text())
    for run in runs:
        for rank in run.ranks():
            trained = rank["optimizer_groups"]
            if engine == "fsdp2":
                assert trained == table  # same tensors and element counts: DTensors count their full shape
            else:  # ZeRO flattens each group into one partition per rank
                keys = ("name", "lr", "weight_decay")
                assert [{k: g[k] for k in keys} for g in trained] == [{k: g[k] for k in keys} for g in table]
    lr = {g["name"]: g["lr"] for g in table}
    assert lr["layer_1.lora_B"] == pytest.approx(16 * lr["layer_1.lora_A"])  # LoRA+
    assert lr["layer_0.lora_A"] == pytest.approx(0.9 * lr["layer_1.lora_A"])  # layer-wise decay


@pytest.mark.parametrize("engine", ALL)
def test_ranks_agree_and_the_adapter_is_the_trained_one(engine, runs):
    final = runs[-1]
    r0, r1 = final.ranks()
    assert r0["global_step"] == r1["global_step"] == 4
    losses = [[h["loss"] for h in r["log_history"] if "loss" in h] for r in (r0, r1)]
    assert losses[0] == losses[1] and len(losses[0]) >= 1 and all(math.isfinite(x) for x in losses[0])
    lora0, lora1 = torch.load(final.probe / "lora_rank0.pt"), torch.load(final.probe / "lora_rank1.pt")
    assert all(torch.equal(lora0[k], lora1[k]) for k in lora0)  # gathered from the shards on each rank
    saved = load_adapter(final.out)
    assert saved.keys() == _peft_names(lora0).keys()
    assert all(torch.equal(saved[k], v) for k, v in _peft_names(lora0).items())
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # trained (lora_B starts at zero)


def test_every_engine_ends_at_the_same_adapter():
    """ZeRO-2 uninterrupted, ZeRO-3 and FSDP2 preempted and resumed: the same data, groups and schedule give the
    same adapter (reduction order aside). A lost LoRA+ group or a resume that skipped or repeated a batch would not."""
    pytest.importorskip("deepspeed")
    adapters = {e: load_adapter(engine_runs(e)[-1].out) for e in ENGINES}
    summaries = {e: _summary(engine_runs(e)[-1]) for e in ENGINES}
    reference = adapters["zero2"]
    for engine, adapter in adapters.items():
        assert adapter.keys() == reference.keys()
        for k in reference:
            torch.testing.assert_close(adapter[k], reference[k], atol=1e-6, rtol=1e-5, msg=f"{engine}: {k}")
        assert summaries[engine]["eval_loss_before"] == pytest.approx(summaries["zero2"]["eval_loss_before"], 1e-6)


@pytest.mark.parametrize("engine", PREEMPTED)
def test_preemption_checkpoints_and_the_rerun_resumes(engine, runs):
    first, second = runs
    assert first.returncode == 143, first.tail()  # SIGTERM reached rank 0 only; rank 1 followed
    assert first.exit_codes() == {0: 143, 1: 143}
    assert [r["global_step"] for r in first.ranks()] == [3, 3]
    ckpt = first.out / "checkpoint-3"
    assert checkpoint_problems(ckpt) == []
    files = {p.name for p in ckpt.iterdir()}
    if engine == "fsdp2":
        assert {"pytorch_model_fsdp.bin", "optimizer.bin", "rng_state_0.pth", "rng_state_1.pth"} <= files
    else:
        assert "global_step3" in files
    assert [r["steps"] for r in second.ranks()] == [[4], [4]]  # resumed after step 3, trained step 4 only
    # the rerun reports the first launch's evaluation before training (from the checkpoint), without re-running it
    measured = [h for h in first.ranks()[0]["log_history"] if "eval_before_loss" in h]
    assert len(measured) == 1 and measured[0]["step"] == 0
    assert _summary(second)["eval_loss_before"] == measured[0]["eval_before_loss"]
    assert "before: eval loss" in first.output and "before: eval loss" not in second.output


@pytest.mark.parametrize("engine", [_engine_param("zero3"), _engine_param("fsdp2")])
def test_a_cold_cache_sharded_start_builds_the_base_once_and_trains(engine, tmp_path):
    """With an empty base cache, rank 0 used to build the embedded base inside `main_process_first` after ZeRO-3's
    TrainingArguments existed: its `from_config` was a `zero.Init` collective that rank 1, waiting at the barrier,
    never joined (both hung). Now the recipe builds the base first, one rank at a time under a file lock. FSDP2 runs
    as the README launches it (`configs/accelerate/fsdp2.yaml`, `cpu_ram_efficient_loading`: rank 1 loads the base
    on the meta device and gets rank 0's weights by broadcast), so a cold cache there is built once as well."""
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    cache = tmp_path / "empty_cache"
    out = tmp_path / "out"
    extra, accelerate_config = ENGINES[engine]
    args = recipe_args(out, steps=2) + CPU + extra + tiny_base_args(cache, pretrain_steps=20)
    run = launch(args, out, nproc=2, timeout=300, accelerate_config=accelerate_config)
    assert run.returncode == 0, run.tail()
    assert _summary(run)["train_steps"] == 2 and math.isfinite(_summary(run)["eval_loss_after"])
    built = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(built) == 1 and run.output.count("building embedded base") == 1  # one build, read by both ranks
