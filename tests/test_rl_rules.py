"""`RLRules` (GRPO / RLOO signals judged against the run's own level): each rule fires on a faulty series, once per
stretch, stating the numbers it compared; the metric series of a real clean tiny GRPO run stay silent."""

from __future__ import annotations

import pytest

from hf_stable.callbacks.monitors.rl_rules import RULES, RLRules

# TRL's logged series of a clean tiny GRPO run (tests/dist_scripts/posttrain_common.build_trainer("grpo", ...,
# max_steps=12, per_device_train_batch_size=8, beta=0.04), under stabilize): the random tiny policy never stops
# before max_completion_length=6, so nearly every completion is truncated from the first step on
CLEAN = {
    "entropy": [5.5623, 5.5621, 5.5622, 5.562, 5.5622, 5.5623, 5.5621, 5.562, 5.5621, 5.562, 5.5621, 5.5622],
    "kl": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0001, 0.0, 0.0001, 0.0, 0.0001, 0.0001],
    "completions/mean_length": [6.0, 6.0, 6.0, 6.0, 5.625, 6.0, 6.0, 6.0, 6.0, 5.375, 6.0, 5.5],
    "completions/clipped_ratio": [1.0, 1.0, 0.875, 1.0, 0.875, 1.0, 1.0, 1.0, 1.0, 0.875, 1.0, 0.875],
}
HEALTHY = {  # a healthier-looking run's levels, with noise, for the faults to depart from
    "entropy": 2.0,
    "kl": 0.002,
    "completions/mean_length": 40.0,
    "completions/clipped_ratio": 0.05,
    "sampling/importance_sampling_ratio/max": 1.8,
    "reward": 0.5,
}
FAULTS = {  # rule -> (key, the value it drifts to)
    "entropy_collapse": ("entropy", 0.05),
    "entropy_blowup": ("entropy", 4.5),
    "kl_blowup": ("kl", 3e4),
    "length_runaway": ("completions/mean_length", 150.0),
    "completions_truncated": ("completions/clipped_ratio", 0.8),
    "importance_ratio_tail": ("sampling/importance_sampling_ratio/max", 5e3),
}


def _run(rules: RLRules, series: dict[str, list[float]]) -> list[dict]:
    n = max(len(v) for v in series.values())
    fired = []
    for i in range(n):
        fired += rules.observe({k: v[i] for k, v in series.items() if i < len(v)})
    return fired


def _healthy(n: int) -> dict[str, list[float]]:
    wobble = [1.0, 1.08, 0.93, 1.05, 0.97, 1.1, 0.9]
    return {k: [v * wobble[i % len(wobble)] for i in range(n)] for k, v in HEALTHY.items()}


def test_the_clean_tiny_grpo_series_stay_silent():
    assert _run(RLRules(), CLEAN) == []
    assert _run(RLRules(), _healthy(60)) == []


def test_every_rule_has_a_fault_here():
    assert sorted(FAULTS) == sorted(r.kind for r in RULES)


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_each_rule_fires_once_on_its_fault_with_the_numbers(kind):
    key, bad = FAULTS[kind]
    series = _healthy(30)
    series[key] = series[key][:20] + [bad] * 10  # drifts at step 21 and stays
    fired = _run(RLRules(), series)
    assert [f["kind"] for f in fired] == [kind]  # once per stretch, no other rule
    hit = fired[0]
    assert hit["early"] == pytest.approx(HEALTHY[key], rel=0.1) and hit["now"] == pytest.approx(bad)
    assert f"{hit['now']:.4g}" in hit["message"] and f"{hit['early']:.4g}" in hit["message"]
    assert "What to do" in hit["message"]


def test_longer_completions_that_earn_more_are_no_runaway():
    series = _healthy(30)
    series["completions/mean_length"] = series["completions/mean_length"][:20] + [150.0] * 10
    series["reward"] = series["reward"][:20] + [0.9] * 10
    assert _run(RLRules(), series) == []


def test_a_rule_re_arms_when_the_signal_is_back_and_its_state_round_trips():
    rules = RLRules()
    series = _healthy(20)
    series["entropy"] = series["entropy"][:10] + [0.05] * 5 + [2.0] * 5
    assert [f["kind"] for f in _run(rules, series)] == ["entropy_collapse"]
    again = RLRules()
    again.load_state_dict(rules.state_dict())
    assert [f["kind"] for f in again.observe({"entropy": 0.05}) + again.observe({"entropy": 0.05})] == []
    assert [f["kind"] for f in _run(again, {"entropy": [0.05] * 3})] == ["entropy_collapse"]
