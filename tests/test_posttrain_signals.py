"""The signals TRL computes, read and judged by `PostTrainMonitor` (`hf_stable.stabilize`) on the real trainers:
logged as ``posttrain/*`` with TRL's own values, a reward function returning ``inf`` named, and no learning signal
(every group rewarded alike for a stretch) said once with what to change - silent on a sparse reward that still
learns now and then."""

from __future__ import annotations

import json
import math

import pytest

import hf_stable
from hf_stable.callbacks.guards import SkipGuard
from hf_stable.callbacks.monitors.post_train_monitor import PostTrainMonitor
from hf_stable.core.events import read_events
from hf_stable.integrations.trl_signals import GenerationBatch, nonfinite_counts
from tests.dist_scripts.posttrain_common import all_finite, build_trainer, trainable

pytest.importorskip("trl")

INF_AT = 3  # the reward function's 3rd call (one generation batch a step): step 3


def flaky_reward(completions, **kwargs):
    """The digit-fraction reward, with one completion scored inf on its `INF_AT`-th call."""
    flaky_reward.calls += 1
    out = [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]
    if flaky_reward.calls == INF_AT:
        out[1] = math.inf
    return out


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def _events(out, kind):
    return [e for e in read_events(out) if e["kind"] == kind]


@pytest.fixture(scope="module")
def inf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inf")
    flaky_reward.calls = 0
    trainer = build_trainer("grpo", out, reward=flaky_reward, max_steps=5, per_device_train_batch_size=8)
    hf_stable.stabilize(trainer).train()
    return out, trainer


def test_an_inf_reward_is_named_with_its_step_and_count(inf_run):
    out, trainer = inf_run
    events = _events(out, "reward_nonfinite")
    assert len(events) == 1, events
    e = events[0]
    assert (e["step"], e["reward_function"], e["completions"], e["of"], e["nonfinite"]) == (
        INF_AT,
        "flaky_reward",
        1,
        8,
        "inf",
    )
    assert e["severity"] == "warning"
    assert "'flaky_reward' returned inf for 1 of 8 completions" in e["message"]
    assert "advantages" in e["message"] and "to 0" in e["message"]
    # the affected group (completion 1: group 0 of 4) written out, so the user sees what was scored
    assert e["rollouts"] == "posttrain_rollouts/step-3-reward_nonfinite.jsonl" and e["rollouts"] in e["message"]
    rows = [json.loads(line) for line in (out / e["rollouts"]).read_text().splitlines()]
    assert [(r["index"], r["group"]) for r in rows] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert rows[1]["rewards"] == {"flaky_reward": "inf"} and rows[0]["prompt"].startswith("count up")
    assert all(isinstance(r["completion"], str) and math.isfinite(r["rewards"]["flaky_reward"]) for r in rows[2:])
    assert len(list((out / "posttrain_rollouts").iterdir())) == 1  # only the faulty batch
    # TRL zeroed the affected group's advantages: the gradient is finite, the step applied, the weights finite
    assert not _events(out, "step_skipped")
    assert all_finite(trainable(trainer.model))


def test_trl_signals_are_logged_under_posttrain_with_trls_values(inf_run):
    _, trainer = inf_run
    rows = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert len(rows) == 5
    for h in rows:
        for key in ("reward", "reward_std", "frac_reward_zero_std", "entropy", "completions/mean_length"):
            assert h[f"posttrain/{key}"] == pytest.approx(h[key], rel=1e-6), (h["step"], key)
        assert "grad/norm_global" in h or "grad_norm" in h  # beside the gradient health, in the same row
        assert "posttrain/num_tokens" not in h and "posttrain/step_time" not in h
    assert math.isinf(rows[INF_AT - 1]["posttrain/reward"])


def test_dpo_margins_and_log_probs_are_logged_under_posttrain(tmp_path):
    trainer = build_trainer("dpo", tmp_path, max_steps=3)
    hf_stable.stabilize(trainer).train()
    rows = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert len(rows) == 3
    for h in rows:
        for key in ("rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
            assert h[f"posttrain/{key}"] == pytest.approx(h[key], rel=1e-6), (h["step"], key)
    assert not _events(tmp_path, "no_learning_signal")


def test_no_learning_signal_is_said_once_with_what_to_change(tmp_path):
    """A constant reward: every group of every batch has zero spread (8 groups a step; said at 32 groups, step 4)."""
    trainer = build_trainer("grpo", tmp_path, reward=constant_reward, max_steps=5, per_device_train_batch_size=32)
    hf_stable.stabilize(trainer).train()
    warnings = [e for e in _events(tmp_path, "no_learning_signal") if e["severity"] == "warning"]
    assert [(e["step"], e["batches"], e["groups"]) for e in warnings] == [(4, 4, 32)]
    message = warnings[0]["message"]
    assert "num_generations=4" in message and "denser reward" in message and "temperature=" in message
    skip = next(c for c in trainer.callback_handler.callbacks if isinstance(c, SkipGuard))
    assert skip.no_signal_warn_steps is None and skip.skipped_total == 0  # the reward-side event replaces its own


def test_a_users_monitor_is_bound_not_replaced_and_the_rest_is_added(tmp_path):
    mine = PostTrainMonitor(zero_std_groups=8)
    trainer = hf_stable.stabilize(build_trainer("grpo", tmp_path, max_steps=1, callbacks=[mine]))
    callbacks = trainer.callback_handler.callbacks
    assert [cb for cb in callbacks if isinstance(cb, PostTrainMonitor)] == [mine] and mine._reader is not None
    assert any(isinstance(cb, SkipGuard) for cb in callbacks)  # build_callbacks was still added


def test_monitor_state_round_trips():
    monitor = PostTrainMonitor()
    for step in range(2):
        monitor.observe_batch(step, _batch(1.0))
    monitor.observe_batch(2, GenerationBatch(rewards={"r": [math.inf, 0.0]}, num_generations=2, frac_zero_std=0.0))
    restored = PostTrainMonitor()
    restored.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
    assert restored.state_dict() == monitor.state_dict() and restored._nonfinite_seen == {"inf:r": 1}


def _batch(frac, groups=8, k=4):
    return GenerationBatch(rewards={"r": [0.0] * (groups * k)}, num_generations=k, frac_zero_std=frac)


def test_no_learning_signal_fires_on_a_sustained_stretch_and_not_on_a_sparse_reward_that_learns(tmp_path):
    monitor = PostTrainMonitor()
    monitor._output_dir = str(tmp_path)
    # sparse but learning: runs of all-zero batches broken by batches with a few groups that differ (measured on
    # the tiny policy with a 0/1 reward: 0.75 / 1.0 alternating at 8 groups, at most 9 single groups in a row)
    sparse = [1.0, 1.0, 0.75, 1.0, 0.875, 1.0, 1.0, 0.5, 1.0, 1.0, 0.875] * 5
    assert not [ev for step, f in enumerate(sparse, 1) for ev in monitor.observe_batch(step, _batch(f))]
    assert not [ev for step in range(9) for ev in monitor.observe_batch(step, _batch(1.0, groups=1))]
    # a faulty series: said once per stretch, again after a batch with signal re-arms it
    monitor.observe_batch(99, _batch(0.5))
    fired = [(s, len(monitor.observe_batch(s, _batch(0.97)))) for s in range(100, 110)]
    assert [s for s, n in fired if n] == [103]
    monitor.observe_batch(110, _batch(0.5))
    assert [s for s in range(111, 120) if monitor.observe_batch(s, _batch(1.0))] == [114]


def test_nonfinite_counts_names_inf_and_unscored_but_not_a_function_that_does_not_apply():
    nan, inf = math.nan, math.inf
    batch = GenerationBatch(
        rewards={"math": [1.0, nan, nan, inf], "format": [0.5, 0.2, nan, 0.1]}, num_generations=4, frac_zero_std=0
    )
    # completion 1: 'math' does not apply (None) but 'format' scored it - TRL's documented use, not counted
    assert nonfinite_counts(batch) == {"math": {"inf": 1, "unscored": 1}, "format": {"inf": 0, "unscored": 1}}
    clean = GenerationBatch(rewards={"r": [0.0, 1.0, 0.0, 0.0]}, num_generations=4, frac_zero_std=0)
    assert nonfinite_counts(clean) == {}
