"""Buffers that grow with the model: the rollback snapshot is sized before the first step, goes to disk when host
memory is short (a simulated limit: `available_host_memory` patched), stops the run when it fits nowhere, and the
doctor reports the sizes."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from hf_stable.callbacks.guards import ClipGuard, LRControl, RollbackGuard, SkipGuard
from hf_stable.config import DEFAULT_CONFIG, load_config
from hf_stable.core import snapshot_size as sizing
from hf_stable.core.events import read_events
from hf_stable.doctor.hazards import check_host_buffers
from hf_stable.doctor.probes import _lora_numel, model_facts
from hf_stable.doctor.settings import resolve_settings
from hf_stable.errors import ConfigError
from hf_stable.optim.phases import PhasedOptimizer
from tests.dist_scripts.guards_common import Recorder, states_equal, tiny_lora_llama, token_data, training_args


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_snapshot_size_predicts_then_measures_the_optimizer_state():
    from lion_pytorch import Lion

    model = tiny_lora_llama(lora=False)
    params, n = list(model.parameters()), _param_bytes(model)
    cases = {
        torch.optim.AdamW(params): 2,
        torch.optim.AdamW(params, amsgrad=True): 3,
        torch.optim.SGD(params, lr=0.1): 0,
        torch.optim.SGD(params, lr=0.1, momentum=0.9): 1,
        Lion(params): 1,
    }
    for opt, tensors in cases.items():
        size = sizing.snapshot_size(opt)
        assert (size.params, size.state, size.probe, size.state_measured) == (n, tensors * n, n, False), opt
    phased = PhasedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), ["sgd", "adamw"])
    assert sizing.snapshot_size(phased).state == 2 * n  # the largest phase
    # after a step the state exists and is measured: AdamW's two moments plus one step counter per tensor
    opt = torch.optim.AdamW(params)
    model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    opt.step()
    size = sizing.snapshot_size(opt)
    assert size.state_measured and size.state == 2 * n + 4 * len(params)


def _run(tmp, monkeypatch, memory: int, disk: int | None = None, ranks: int = 1, damage=()):
    """A LoRA run with skip + rollback (snapshots every 3 good steps); host memory (and disk) patched."""
    from tests.dist_scripts.guards_common import WeightDamage

    monkeypatch.setattr(sizing, "available_host_memory", lambda: memory)
    if disk is not None:
        monkeypatch.setattr(sizing, "free_disk", lambda path: disk)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    model = tiny_lora_llama()
    rec = Recorder(model)
    skip, lr = SkipGuard(), LRControl()
    rollback = RollbackGuard(skip, lr, snapshot_every=3, bad_steps=2, window=4)
    args = training_args(tmp, max_steps=11)
    callbacks = [skip, rollback, ClipGuard(skip_guard=skip), lr, rec, WeightDamage(model, damage)]
    trainer = Trainer(model=model, args=args, train_dataset=token_data(), callbacks=callbacks)
    return trainer, rollback, rec, model


def test_a_snapshot_too_large_for_host_memory_goes_to_disk_and_still_rolls_back(tmp_path, monkeypatch):
    n = _param_bytes(tiny_lora_llama())
    snapshot = 3 * n  # weights + AdamW's two moments
    # 4 ranks on the host share 6x a snapshot; half of it per the default share: 0.75 snapshot per rank
    trainer, rollback, rec, _ = _run(tmp_path, monkeypatch, memory=6 * snapshot, ranks=4, damage=[7])
    trainer.train()
    events = read_events(tmp_path)
    (notice,) = [e for e in events if e["kind"] == "guard_notice"]
    assert notice["storage"] == "disk" and notice["snapshot_bytes"] == snapshot and notice["verify"]
    assert "stability.guards.rollback.storage" in notice["message"] and "4 rank(s)" in notice["message"]
    assert rollback.storage_in_use == "disk" and (tmp_path / "hf_stable_rollback" / "rank0.pt").is_file()
    # the same rollback as from memory: damage after 7 -> bad 8, 9 -> restored bitwise from the file of step 6,
    # after the data-or-weights check re-ran the batch at the snapshot's (memory-mapped) weights
    (event,) = [e for e in events if e["kind"] == "rollback"]
    assert (event["step"], event["value"], event["check"]) == (9, 6, "damaged weights")
    assert all(torch.equal(rec.weights[9][k], rec.weights[6][k]) for k in rec.weights[6])
    assert states_equal(rec.opt_state[9], rec.opt_state[6])
    # with 4x the memory the same run keeps its snapshots in memory, without a notice
    trainer, rollback, _, _ = _run(tmp_path / "roomy", monkeypatch, memory=24 * snapshot, ranks=4)
    trainer.train()
    assert rollback.storage_in_use == "memory" and not read_events(tmp_path / "roomy")


def test_a_snapshot_that_fits_nowhere_stops_the_run_before_the_first_step(tmp_path, monkeypatch):
    n = _param_bytes(tiny_lora_llama())
    trainer, _, _, model = _run(tmp_path, monkeypatch, memory=n, disk=2 * n)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    with pytest.raises(ConfigError) as err:
        trainer.train()
    text = str(err.value)
    assert "stability.guards.rollback.storage" in text and "stability.guards.rollback.enabled: false" in text
    assert "lora.enabled: true" in text and "MiB" in text
    assert trainer.state.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in model.named_parameters() if v.requires_grad)


def test_doctor_reports_the_snapshot_sizes(tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    # the LoRA estimate from a weight-free model equals peft's own count
    cfg = load_config(DEFAULT_CONFIG, ["--training.output_dir", str(tmp_path)])
    base = tiny_lora_llama(lora=False)
    lora = get_peft_model(
        tiny_lora_llama(lora=False), LoraConfig(r=cfg.lora.r, target_modules=cfg.lora.target_modules)
    )
    assert _lora_numel(base, cfg.lora) == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    # a full fine-tune: plenty of memory -> info with the numbers; short memory -> disk (warning); nowhere -> error
    full = load_config(DEFAULT_CONFIG, ["--training.output_dir", str(tmp_path), "--lora.enabled", "false"])
    facts, s = model_facts(base), resolve_settings(full)
    snapshot = 3 * facts.trainable_bytes
    findings = {}
    for memory, disk in ((100 * snapshot, None), (snapshot, None), (snapshot // 10, snapshot // 10)):
        monkeypatch.setattr(sizing, "available_host_memory", lambda m=memory: m)
        if disk is not None:
            monkeypatch.setattr(sizing, "free_disk", lambda path, d=disk: d)
        (finding,) = check_host_buffers(full, s, facts)
        findings[finding.severity] = finding
    assert list(findings) == ["info", "warning", "error"]
    assert f"{facts.trainable_numel:,} trainable parameters" in findings["info"].evidence
    assert "optimizer state" in findings["info"].evidence and "update monitor" in findings["info"].evidence
    assert "storage: disk" in findings["warning"].fix and findings["error"].blocking
