"""The rescue benchmark's peer arms follow the rules they cite (benchmarks/peers.py): hand-computed cases, no Trainer."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TrainerControl, TrainerState

peers = pytest.importorskip("benchmarks.peers")


def _model_with_grad(grad: list[float]) -> torch.nn.Module:
    model = torch.nn.Linear(len(grad), 1, bias=False)
    model.weight.grad = torch.tensor([grad])
    return model


def test_olmo_skip_needs_half_the_window_then_skips_a_6_sigma_outlier():
    rule = peers.OlmoSkipStep(window=128, sigma=6.0)
    noise = [1.0 + 0.01 * ((i * 7) % 5 - 2) for i in range(80)]
    verdicts = [rule.decide(i + 1, loss, loss, None) for i, loss in enumerate(noise[:62])]
    assert verdicts == [None] * 62
    assert rule.decide(63, 50.0, 1.0, None) is None  # 63 values of history: below 64, no verdict yet
    rule = peers.OlmoSkipStep(window=128, sigma=6.0)
    for i, loss in enumerate(noise[:70]):
        rule.decide(i + 1, loss, loss, None)
    assert rule.decide(71, 1.5, 1.0, None) == "skip"  # loss > mean + 6 std
    assert rule.decide(72, 1.0, 1.5, None) == "skip"  # grad norm > mean + 6 std
    assert rule.decide(73, 1.0, 1.0, None) is None
    n = len(rule.losses)
    assert rule.decide(74, math.nan, 1.0, None) == "skip" and len(rule.losses) == n  # non-finite: kept out


def test_nonfinite_stop_and_megatron_spiky_loss_flag():
    rule = peers.NonFiniteStop(spiky_factor=10.0, spiky_samples=3)
    assert [rule.decide(i, 2.0, 1.0, None) for i in (1, 2, 3)] == [None] * 3
    assert rule.decide(4, 25.0, 1.0, None) is None and rule.spiky_flags == 1  # >= 10x the max: flagged, continues
    assert rule.decide(5, 1.0, math.inf, None) == "stop"


def test_zclip_reciprocal_rule_clips_to_mean_plus_z_thresh_squared_std_over_z():
    rule = peers.ZClip(alpha=0.97, z_thresh=2.5, warmup=4, max_norm=100.0)
    for i, g in enumerate([1.0, 1.2, 1.0, 1.2]):  # warm-up: mean 1.1, std 0.1
        model = _model_with_grad([g])
        rule.norm = torch.tensor(g)
        rule.decide(i + 1, 1.0, g, model)
    model = _model_with_grad([3.0, 4.0])  # norm 5: z = 39
    rule.norm = torch.tensor(5.0)
    rule.decide(5, 1.0, 5.0, model)
    expected = 1.1 + 2.5**2 * 0.1 / ((5.0 - 1.1) / (0.1 + 1e-6))
    assert float(model.weight.grad.norm()) == pytest.approx(expected, rel=1e-4)
    assert rule.mean == pytest.approx(0.97 * 1.1 + 0.03 * expected, rel=1e-4)  # the clipped value feeds the EMA


def test_spam_resets_moments_with_a_warmup_and_clips_element_spikes():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = peers.SpamAdamW([p], lr=0.1, interval=4, warmup=2, threshold=5000.0, clip_after=2)
    for _ in range(3):
        p.grad = torch.tensor([1.0, 1.0])
        opt.step()
    before = p.detach().clone()
    p.grad = torch.tensor([1.0, 50.0])  # step 4: a reset step (4 % 4 == 0): fresh moments, update scale 0.01
    opt.step()
    assert torch.allclose(opt.state[p]["m"], torch.tensor([0.1, 5.0]))  # (1 - beta1) * g, nothing carried over
    t = 4
    step = 0.1 * math.sqrt(1 - 0.999**t) / (1 - 0.9**t) * 0.01
    assert float(before[0] - p.detach()[0]) == pytest.approx(step * 0.1 / (math.sqrt(0.001) + 1e-6), rel=1e-4)
    for _ in range(2):  # steps 5-6: 5 % 4 = 1 < clip_after, 6 % 4 = 2 >= clip_after
        p.grad = torch.tensor([1.0, 1.0])
        opt.step()
    v, n_clipped = opt.state[p]["v"].clone(), opt.clipped
    p.grad = torch.tensor([1.0, 1000.0])  # step 7: element 1 is a spike (g^2 > 5000 v), element 0 is not
    opt.step()
    clipped = math.sqrt(5000.0 * float(v[1]))
    assert float(opt.state[p]["v"][1]) == pytest.approx(0.999 * float(v[1]) + 0.001 * clipped**2, rel=1e-5)
    assert float(opt.state[p]["v"][0]) == pytest.approx(0.999 * float(v[0]) + 0.001, rel=1e-5)
    assert opt.clipped == n_clipped + 1


def test_loss_watchdog_stops_after_patience_consecutive_high_losses():
    dog = peers.LossWatchdog(threshold=5.0, patience=3)
    state, control = TrainerState(), TrainerControl()
    for step, loss in enumerate([6.0, 6.0, 1.0, 6.0, 6.0], start=1):
        state.log_history.append({"loss": loss})
        state.global_step = step
        dog.on_step_end(None, state, control)
    assert not control.should_training_stop  # the dip at step 3 reset the count
    state.log_history.append({"loss": 7.0})
    state.global_step = 6
    dog.on_step_end(None, state, control)
    assert control.should_training_stop and dog.stopped_at == 6
