"""Fault injection with a real Trainer and a tiny LoRA Llama: skip, spike handling, rollback, schedule, resume.

Each test injects a fault (NaN or x1000 loss at chosen steps, which makes the gradients NaN or 1000x) and asserts
outcomes: weights bitwise unchanged by a skipped step, optimizer state bitwise restored by a rollback, LR halved,
the plain Trainer's weights ruined by the same fault.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import Trainer

from hf_stable.callbacks.guards import ClipGuard, LRControl, RollbackGuard, SkipGuard, build_guards
from hf_stable.config.guards import GuardsConfig
from hf_stable.core.events import read_events
from tests.dist_scripts.guards_common import (
    LossFault,
    Recorder,
    WeightDamage,
    all_finite,
    states_equal,
    tiny_lora_llama,
    token_data,
    training_args,
    weights_equal,
)


def _run(tmp, callbacks_for, faults=(), factor=float("nan"), data=None, resume=None, damage=(), **args_kw):
    """`faults`: steps whose loss is x `factor` (bad data); `damage`: steps after whose update the weights are
    damaged (what a too-large update does) until a rollback."""
    model = tiny_lora_llama()
    if faults:
        LossFault(model, faults, factor)
    rec = Recorder(model)
    args = training_args(tmp, **args_kw)
    guards = callbacks_for(model)
    extra = [WeightDamage(model, damage)] if damage else []
    trainer = Trainer(model=model, args=args, train_dataset=data or token_data(), callbacks=[*guards, rec, *extra])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, rec, guards


def _defaults(**changes):
    cfg = GuardsConfig()
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return lambda model: build_guards(cfg)


def _guard(guards, cls):
    return next(g for g in guards if isinstance(g, cls))


def test_nan_step_is_skipped_bitwise_and_plain_trainer_ends_nan(tmp_path):
    steps, nan_at = 10, 5
    trainer, rec, _guards = _run(
        tmp_path / "guarded", _defaults(), faults=[nan_at], max_steps=steps, lr_scheduler_type="linear"
    )
    # the skipped step moved nothing: weights and optimizer state bitwise as after the step before
    assert weights_equal(rec.weights[nan_at - 1], rec.weights[nan_at])
    assert states_equal(rec.opt_state[nan_at - 1], rec.opt_state[nan_at])
    assert not weights_equal(rec.weights[nan_at], rec.weights[nan_at + 1])  # training goes on
    assert all_finite(rec.weights[steps])
    skipped = [e for e in read_events(tmp_path / "guarded") if e["kind"] == "step_skipped"]
    assert [e["step"] for e in skipped] == [nan_at] and skipped[0]["reasons"] == ["nonfinite"]
    # the schedule still advanced on the skipped step: LR after step t is lr * (1 - t / T), t = 1..T
    assert trainer.lr_scheduler.last_epoch == steps
    for t in range(1, steps + 1):
        assert rec.lrs[t][0] == pytest.approx(1e-3 * (1 - t / steps)), t

    # the plain Trainer (its default clipping, max_grad_norm=1.0) with the same fault: every weight NaN at the end
    _, plain, _ = _run(tmp_path / "plain", lambda m: [], faults=[nan_at], max_steps=steps, max_grad_norm=1.0)
    assert all_finite(plain.weights[nan_at - 1])
    assert not any(bool(torch.isfinite(w).any()) for w in plain.weights[steps].values())


def test_x1000_gradient_spike_is_skipped_by_default_and_clipped_without_skip(tmp_path):
    spike_at, steps = 8, 9
    _, rec, guards = _run(tmp_path / "skip", _defaults(), faults=[spike_at], factor=1e3, max_steps=steps)
    skip = _guard(guards, SkipGuard)
    assert skip.skipped_steps == [spike_at] and "grad_spike" in skip.events[0]["reasons"]
    assert weights_equal(rec.weights[spike_at - 1], rec.weights[spike_at])

    # skip off, adaptive clipping only: the spiked step's gradient is scaled back to the usual size
    trainer, rec, guards = _run(
        tmp_path / "clip",
        _defaults(skip__enabled=False, rollback__enabled=False),
        faults=[spike_at],
        factor=1e3,
        max_steps=steps,
    )
    clip = _guard(guards, ClipGuard)
    history = {h["step"]: h for h in trainer.state.log_history if "clip/norm_after" in h}
    assert history[spike_at]["clip/coef_min"] < 5e-3  # a ~400-norm gradient scaled to the cap
    assert history[spike_at]["clip/norm_after"] <= 1.0 + 1e-6  # the outer cap
    normal = [history[s]["clip/norm_after"] for s in range(2, spike_at)]
    assert history[spike_at]["clip/norm_after"] < 3 * max(normal)
    assert clip.state_dict()["clipped_steps"] >= 1
    assert all_finite(rec.weights[steps])


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_k_bad_steps_roll_back_bitwise_and_halve_the_lr(tmp_path, storage):
    def guards_for(model):
        skip, lr = SkipGuard(), LRControl()
        return [
            skip,
            RollbackGuard(skip, lr, snapshot_every=3, bad_steps=2, window=4, storage=storage),
            ClipGuard(skip_guard=skip),
            lr,
        ]

    # good 1..7 (snapshots after 3 and 6), weights damaged after step 7's update: steps 8 and 9 are bad, the
    # second bad step within 4 triggers the rollback (the probe finds the batch fine at step 6's weights)
    _trainer, rec, guards = _run(tmp_path, guards_for, damage=[7], max_steps=11)
    rollback = _guard(guards, RollbackGuard)
    assert rollback.rollbacks == 1
    assert weights_equal(rec.weights[9], rec.weights[6])  # restored exactly (step 7's update undone)
    assert not weights_equal(rec.weights[7], rec.weights[6])
    assert states_equal(rec.opt_state[9], rec.opt_state[6])
    assert int(rec.opt_state[9][0]["step"]) == 6
    events = [e for e in read_events(tmp_path) if e["kind"] == "rollback"]
    assert len(events) == 1 and events[0]["step"] == 9 and events[0]["value"] == 6
    # LR: the scheduler's value stays (constant 1e-3); the optimizer used half of it from step 9 on
    assert rec.lrs[11][0] == pytest.approx(1e-3)
    assert rec.effective_lrs[8][0] == pytest.approx(1e-3) and rec.effective_lrs[10][0] == pytest.approx(5e-4)
    assert _guard(guards, LRControl).factors == {"rollback": 0.5}
    assert all_finite(rec.weights[11])
    assert (Path(tmp_path) / "hf_stable_rollback" / "rank0.pt").is_file() == (storage == "disk")


@pytest.mark.parametrize("bf16", [False, True])  # bf16: the probe re-runs under the Trainer's CPU autocast
def test_bad_data_is_skipped_without_a_rollback_bad_weights_are_rolled_back(tmp_path, bf16):
    def guards_for(model):
        skip, lr = SkipGuard(), LRControl()
        return [skip, RollbackGuard(skip, lr, snapshot_every=3, bad_steps=2, window=4), ClipGuard(skip_guard=skip), lr]

    # NaN loss at 8 and 9 (bad data): the probe finds step 9's batch fine at the current weights too - nothing
    # was damaged (8 and 9 were skipped), so the good steps since the snapshot (step 7) are kept, LR unchanged
    _, rec, guards = _run(tmp_path / "data", guards_for, faults=[8, 9], max_steps=11, bf16=bf16)
    (declined,) = [e for e in read_events(tmp_path / "data") if e["kind"].startswith("rollback")]
    assert declined["kind"] == "rollback_declined" and declined["step"] == 9 and declined["value"] == 6
    assert _guard(guards, RollbackGuard).rollbacks == 0 and _guard(guards, LRControl).product == 1.0
    assert weights_equal(rec.weights[9], rec.weights[7]) and not weights_equal(rec.weights[7], rec.weights[6])
    assert not weights_equal(rec.weights[10], rec.weights[9])  # training goes on from step 7's weights
    # the same two bad steps caused by damaged weights: the batch is fine at the snapshot's -> rolled back
    _, rec, guards = _run(tmp_path / "weights", guards_for, damage=[7], max_steps=11, bf16=bf16)
    assert _guard(guards, RollbackGuard).rollbacks == 1 and weights_equal(rec.weights[9], rec.weights[6])
    (event,) = [e for e in read_events(tmp_path / "weights") if e["kind"].startswith("rollback")]
    assert event["kind"] == "rollback" and event["check"] == "damaged weights"
    assert all_finite(rec.weights[11])


@pytest.mark.parametrize("escalate", [True, False])
def test_repeated_rollbacks_to_one_snapshot_escalate_the_backoff(tmp_path, escalate):
    def guards_for(model):
        skip, lr = SkipGuard(), LRControl()
        return [
            skip,
            RollbackGuard(skip, lr, snapshot_every=3, bad_steps=2, window=4, escalate=escalate),
            ClipGuard(skip_guard=skip),
            lr,
        ]

    # snapshots after 3 and 6; damage after 7 -> bad 8-9 -> rollback to 6; bad data at 10-11 right after (a burst:
    # nothing applied since, the weights are still step 6's) -> held, no second backoff; good 12, damaged after
    # it -> bad 13-14 -> to 6 after a recovery: escalated; good 15-17 -> new snapshot at 17, damaged after it ->
    # bad 18-19 -> rollback to 17, which starts the backoff afresh
    _, rec, guards = _run(tmp_path, guards_for, faults=[10, 11], damage=[7, 12, 17], max_steps=20)
    all_events = read_events(tmp_path)
    events = [e for e in all_events if e["kind"] == "rollback"]
    assert [(e["step"], e["value"]) for e in events] == [(9, 6), (14, 6), (19, 17)]
    assert [(e["step"], e["value"]) for e in all_events if e["kind"] == "rollback_held"] == [(11, 6)]
    assert weights_equal(rec.weights[11], rec.weights[6]) and states_equal(rec.opt_state[11], rec.opt_state[6])
    expected = [0.5, 0.25, 0.5] if escalate else [0.5, 0.5, 0.5]
    assert [e["backoff"] for e in events] == pytest.approx(expected)
    factor = math.prod(expected)
    assert _guard(guards, LRControl).factors == {"rollback": pytest.approx(factor)}
    assert rec.effective_lrs[20][0] == pytest.approx(1e-3 * factor)
    assert weights_equal(rec.weights[14], rec.weights[6]) and weights_equal(rec.weights[19], rec.weights[17])
    assert all_finite(rec.weights[20])


def test_resume_restores_every_guard_state(tmp_path):
    cfg = GuardsConfig()
    cfg.rollback.bad_steps, cfg.rollback.window, cfg.rollback.snapshot_every = 2, 3, 2
    cfg.clipping.warmup_steps = 3
    cfg.snr.enabled, cfg.snr.interval = True, 3

    def guards_for(model):
        return build_guards(cfg)

    kw = {"max_steps": 8, "save_strategy": "steps", "save_steps": 4}
    full, rec_full, g_full = _run(tmp_path / "full", guards_for, damage=[1], **kw)
    assert _guard(g_full, RollbackGuard).rollbacks == 1
    _resumed, rec_res, g_res = _run(tmp_path / "res", guards_for, resume=str(tmp_path / "full" / "checkpoint-4"), **kw)
    saved = full.state.stateful_callbacks["hf_stable"]
    for guard in g_res:
        a, b = guard.state_dict(), saved[guard.state_key]
        assert _close(a, b), (guard.state_key, a, b)
    assert _guard(g_res, LRControl).factors == {"rollback": 0.5}
    assert rec_res.effective_lrs[6][0] == pytest.approx(rec_full.effective_lrs[6][0])
    for name, w in rec_full.weights[8].items():
        torch.testing.assert_close(rec_res.weights[8][name], w, rtol=1e-5, atol=1e-7)


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-5, abs=1e-9)
    return a == b


def test_logged_learning_rate_is_the_lr_applied_after_a_rollback(tmp_path):
    """After a rollback halves the LR, the Trainer's own `learning_rate` log shows the LR the optimizer applied
    (what users read in TensorBoard / W&B); the schedule's value is kept under `lr/scheduled`."""

    def guards_for(model):
        skip, lr = SkipGuard(), LRControl()
        return [skip, RollbackGuard(skip, lr, snapshot_every=3, bad_steps=2, window=4), ClipGuard(skip_guard=skip), lr]

    trainer, rec, guards = _run(tmp_path, guards_for, damage=[7], max_steps=11)
    assert _guard(guards, RollbackGuard).rollbacks == 1
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == list(range(1, 12))
    for step, row in logged.items():
        assert row["learning_rate"] == pytest.approx(rec.effective_lrs[step][0]), step
        assert row["lr/scheduled"] == pytest.approx(1e-3) and row["lr/effective"] == row["learning_rate"], step
    assert logged[8]["learning_rate"] == pytest.approx(1e-3) and logged[10]["learning_rate"] == pytest.approx(5e-4)
