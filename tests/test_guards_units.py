"""Guard decisions without a training loop (clipping math, LR factors over real schedulers, skip rules, config),
plus one Trainer run showing that `global` clipping is exactly the Trainer's own clipping."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
from transformers import Trainer, TrainerControl, TrainerState

from hf_stable.callbacks.guards import (
    ClipGuard,
    LRControl,
    RollbackGuard,
    SkipGuard,
    build_guards,
    guard_training_overrides,
)
from hf_stable.callbacks.guards.clip_guard import site_of
from hf_stable.callbacks.guards.snr_guard import SNRGuard
from hf_stable.config import config_from_dict
from hf_stable.config.guards import GuardsConfig
from hf_stable.core import GuardOrderError
from hf_stable.core.grad_stats import GradStats
from hf_stable.errors import ConfigError
from tests.dist_scripts.guards_common import Recorder, tiny_lora_llama, token_data, training_args


# --- clipping -------------------------------------------------------------------------------------------------
def _model_with_grads(scale_by_group: dict[str, float], seed=0):
    model = tiny_lora_llama(lora=False)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        from hf_stable.optim.roles import classify

        p.grad = torch.randn(p.shape, generator=g) * scale_by_group.get(site_of(classify(name).group), 1.0)
    return model


def _hook(guard, model, step=0):
    args = training_args("/tmp/unused")
    state = TrainerState()
    state.global_step = step
    guard.on_pre_optimizer_step(args, state, TrainerControl(), model=model)


def _group_norms(model, step):
    GradStats.shared(model).invalidate()
    return GradStats.shared(model).compute(model, step=step + 1000).group_norms


def test_per_group_clipping_caps_each_group_at_its_site_threshold():
    model = _model_with_grads({"embeddings": 5.0, "layer": 0.001, "lm_head": 5.0, "norm": 5.0})
    before = GradStats.shared(model).compute(model, step=0).group_norms
    guard = ClipGuard(mode="per_group")
    _hook(guard, model)
    after = _group_norms(model, 0)
    limits = {"embeddings": 0.3, "layer": 0.8, "lm_head": 0.5, "norm": 0.8}
    for group, norm in after.items():
        limit = limits[site_of(group)]
        assert norm == pytest.approx(min(before[group], limit), rel=1e-4), group
    assert after["layer_0"] == pytest.approx(before["layer_0"], rel=1e-6)  # under its limit: untouched
    assert before["embeddings"] > 1.0 and after["embeddings"] == pytest.approx(0.3, rel=1e-4)


def test_adaptive_clipping_follows_each_groups_statistics():
    guard = ClipGuard(mode="adaptive", max_norm=None, warmup_steps=10, z_threshold=2.5, ema_alpha=0.97)
    rng = random.Random(0)
    for _ in range(40):
        coefs = guard.coefficients({"a": 1.0 + rng.gauss(0, 0.05), "b": 100.0 + rng.gauss(0, 5)}, 100.0)
        assert coefs["b"] > 0.9  # normal wobble of a large-norm group is not clipped
    mean_a, var_a, _ = guard.state_dict()["stats"]["a"]
    limit = mean_a + 2.5 * math.sqrt(var_a)
    coefs = guard.coefficients({"a": 50.0, "b": 100.0}, 111.8)
    assert coefs["a"] == pytest.approx(limit / 50.0, rel=1e-9)  # scaled to mean + z * std
    assert coefs["b"] == 1.0  # groups are judged separately
    assert guard.state_dict()["stats"]["a"][0] < 1.2  # the EMA learned the clipped value, not 50
    # the outer global cap applies on top
    capped = ClipGuard(mode="adaptive", max_norm=1.0, warmup_steps=10)
    coefs = capped.coefficients({"a": 3.0, "b": 4.0}, 5.0)  # warm-up: only the cap
    assert coefs == {"a": pytest.approx(0.2, rel=1e-5), "b": pytest.approx(0.2, rel=1e-5)}


def test_agc_bounds_each_row_relative_to_its_weight_row():
    model = _model_with_grads({"layer": 50.0, "embeddings": 50.0, "lm_head": 50.0, "norm": 50.0})
    guard = ClipGuard(mode="global", max_norm=1e9, agc_lambda=0.01)
    _hook(guard, model)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            ratio = p.grad.norm(dim=1) / p.detach().norm(dim=1).clamp_min(1e-3)
            assert float(ratio.max()) <= 0.01 * (1 + 1e-4), name


def test_global_mode_equals_the_trainers_own_clipping(tmp_path):
    def run(out, callbacks, max_grad_norm):
        model = tiny_lora_llama()
        rec = Recorder(model)
        args = training_args(out, max_steps=4, max_grad_norm=max_grad_norm)
        Trainer(model=model, args=args, train_dataset=token_data(16), callbacks=[*callbacks, rec]).train()
        return rec.weights[4]

    ours = run(tmp_path / "ours", [ClipGuard(mode="global", max_norm=0.05)], 0.0)
    theirs = run(tmp_path / "theirs", [], 0.05)
    unclipped = run(tmp_path / "none", [], 0.0)
    for name, w in theirs.items():
        torch.testing.assert_close(ours[name], w, rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(unclipped[n], theirs[n], rtol=1e-4, atol=1e-6) for n in theirs)


# --- LR factors over real schedulers ----------------------------------------------------------------------------
def _opt():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    return torch.optim.SGD([{"params": [params[0]], "lr": 1.0}, {"params": [params[1]], "lr": 0.1}])


def _lr_step(control, opt):
    args, state, ctl = training_args("/tmp/unused"), TrainerState(), TrainerControl()
    control.on_pre_optimizer_step(args, state, ctl, optimizer=opt)
    used = [g["lr"] for g in opt.param_groups]
    opt.step()  # no gradients: a no-op that keeps the scheduler's step-order check quiet
    control.on_optimizer_step(args, state, ctl, optimizer=opt)
    return used


def test_lr_factor_persists_on_top_of_a_lambda_schedule():
    opt = _opt()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (t + 1) / 4 if t < 4 else 1.0)
    control = LRControl()
    for t in range(6):
        if t == 2:
            control.multiply("rollback", 0.5)
        used = _lr_step(control, opt)
        f = 0.5 if t >= 2 else 1.0
        want = min((t + 1) / 4, 1.0)
        assert used == pytest.approx([want * f, 0.1 * want * f]), t
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([want, 0.1 * want])  # schedule's own value
        sched.step()


def test_lr_factor_does_not_compound_with_a_chainable_scheduler_and_applies_mid_step():
    opt = _opt()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)  # reads group["lr"] each step
    control = LRControl()
    control.set_factor("snr", 0.5)
    for t in range(5):
        assert _lr_step(control, opt)[0] == pytest.approx(0.5 * 0.9**t)
        sched.step()
    args, state, ctl = training_args("/tmp/unused"), TrainerState(), TrainerControl()
    control.on_pre_optimizer_step(args, state, ctl, optimizer=opt)
    control.set_factor("rollback", 0.1)  # decided later in the same hook: applied at once
    assert opt.param_groups[0]["lr"] == pytest.approx(0.9**5 * 0.05)
    control.on_optimizer_step(args, state, ctl, optimizer=opt)
    assert control.product == pytest.approx(0.05) and LRControl(min_factor=0.2).product == 1.0


# --- skip rules and ordering -----------------------------------------------------------------------------------
def test_skip_rules_on_constructed_traces():
    skip = SkipGuard(grad_spike_ratio=10, loss_spike_zscore=6, warmup_steps=5, max_consecutive_skips=4)
    assert skip.local_flags(float("nan"), 1.0) == [1, 0, 0, 0]
    assert skip.local_flags(1.0, float("inf")) == [1, 0, 0, 0]
    assert skip.local_flags(1e9, 1.0) == [0, 0, 0, 0]  # no spike verdict during warm-up
    rng = random.Random(0)
    for step in range(1, 31):
        skip.decide(step, [0, 0, 0, 0], 1.0 + rng.gauss(0, 0.1), 3.0 - step * 0.01 + rng.gauss(0, 0.02))
    assert skip.local_flags(1.5, 2.7) == [0, 0, 0, 0]
    assert skip.local_flags(20.0, 2.7) == [0, 1, 0, 0]
    assert skip.local_flags(1.0, 4.0) == [0, 0, 0, 0]  # 1.4x the median: a hard batch, not a spike
    assert skip.local_flags(1.0, 6.0) == [0, 0, 1, 0]  # 2.1x the median: a spike (not yet a rise)
    state = skip.stats_state()
    skip.decide(31, skip.local_flags(1e4, 6.0), 1e4, 6.0)  # spikes teach the references nothing
    assert skip.stats_state()["norm_ema"] == state["norm_ema"] and skip.stats_state()["losses"] == state["losses"]
    assert skip.stats_state()["recent"] == state["recent"]  # an isolated spike does not move the trend
    # a divergence: the loss climbs 8% a step; the fast trend crosses +50% over the recent best (step 39, loss
    # 1.85x) before any single loss is a 2x spike, then the spike rule takes over
    loss, reasons, healthy = 2.7, {}, {}
    for step in range(32, 45):
        loss *= 1.08
        reasons[step] = skip.decide(step, skip.local_flags(1.0, loss), 1.0, loss).reasons
        healthy[step] = skip.healthy  # False: RollbackGuard takes no snapshot during the rise
    assert all(not reasons[s] for s in range(32, 39))
    assert reasons[39] == reasons[40] == ["loss_rise"] and reasons[41] == ["loss_spike"]
    assert healthy[34] and not any(healthy[s] for s in range(37, 43))
    # a level that persists is eventually accepted as the new normal (max_consecutive_skips=4)
    assert [e["kind"] for e in skip.events].count("skip_reference_reset") >= 1
    assert 31 in skip.skipped_steps and skip.skipped_total < 14


def test_skip_evidence_is_the_same_whether_a_rule_or_another_reason_skips_the_step():
    """The window's noise is measured only when a rule comes near or the step is skipped: a step skipped for
    another reason (ranks that disagree, damaged RL inputs) carries the same evidence as when it was always measured."""

    def warm_guard():
        skip = SkipGuard(warmup_steps=5)
        rng = random.Random(1)
        for step in range(1, 41):
            skip.decide(step, [0, 0, 0, 0], 1.0 + rng.gauss(0, 0.1), 3.0 - step * 0.01 + rng.gauss(0, 0.02))
        return skip

    quiet, eager = warm_guard(), warm_guard()
    assert quiet.local_flags(1.0, 2.6) == [0, 0, 0, 0]
    assert quiet._finish_evidence is not None  # nothing measured yet
    noise = eager.noise()
    evidence = quiet.last_evidence  # a skip for another reason reads it: measured now
    assert {k: evidence[k] for k in ("loss_median", "loss_step_noise", "grad_log_scale")} == {
        k: noise[k] for k in ("loss_median", "loss_step_noise", "grad_log_scale")
    }
    assert evidence["window_steps"] == noise["n"] and "rise_log" in evidence and "rise_sigma" in evidence
    quiet.damage_flag({"rl_nonfinite_logps": 2.0, "rl_ratio_tail": 0.0})
    assert list(quiet.last_evidence)[-3:] == ["nonfinite_logps", "ratio_tail", "ratio_max"]
    verdict = quiet.decide(41, [0, 0, 0, 0, 1.0, 0.0], 1.0, 2.6)  # rank_mismatch
    event = quiet.events[-1]
    assert verdict.skip and event["kind"] == "step_skipped" and event["noise"]["window_steps"] == noise["n"]
    assert "step noise" not in event["message"]  # a rank mismatch explains no finite rule
    flags = eager.local_flags(1.0, 9.0)  # a loss spike: its evidence is complete at once
    assert flags == [0, 0, 1, 0] and eager._finish_evidence is None and eager.last_evidence["loss_z"] > 6


def test_a_guard_listed_before_the_skip_guard_is_an_error():
    skip = SkipGuard()
    with pytest.raises(GuardOrderError, match="list SkipGuard before"):
        skip.verdict_for(1)


def test_snr_factor_moves_and_is_clamped():
    lr = LRControl()
    snr = SNRGuard(lr, interval=10, current_window=1, min_factor=0.5)
    for step in range(1, 30):
        snr.observe(step, 1.0)
    snr.observe(30, 2.0)  # ratio 2 > 1.3
    assert lr.factor("snr") == pytest.approx(0.8)
    for step in range(31, 100):
        snr.observe(step, 3.0 if step % 10 == 0 else 1.0)
    assert lr.factor("snr") == pytest.approx(0.5)  # clamped
    for step in range(100, 300):
        snr.observe(step, 0.1 if step % 10 == 0 else 1.0)
    assert lr.factor("snr") == pytest.approx(1.0)  # max_factor 1: back to the schedule, never above
    above = SNRGuard(LRControl(), interval=10, current_window=1, max_factor=1.5)
    for step in range(1, 300):
        above.observe(step, 0.1 if step % 10 == 0 else 1.0)
    assert above.lr_control.factor("snr") == pytest.approx(1.5)  # an explicit max_factor > 1 lifts it


def test_snr_leaves_a_healthy_lora_run_alone():
    """A clean LoRA fine-tune: the norm grows over the first steps (B starts at zero, LR warmup), then wanders in
    band (0.9-1.2x). The old rule checked at steps 10 and 20 against an EMA still near the first norm (ratio
    ~1.5) and cut the LR to 0.64; a check now waits for the EMA's history and acts only far outside the band."""
    lr = LRControl()
    snr = SNRGuard(lr, interval=10)
    assert snr.warmup == 30  # 1 / (1 - 0.95) + current_window 10
    for step in range(1, 201):
        norm = 0.2 + 0.8 * step / 25 if step <= 25 else 1.0 + 0.15 * math.sin(step / 3)
        snr.observe(step, norm)
    assert lr.factor("snr") == 1.0 and snr.events == []


def test_snr_lowers_on_a_surge_and_recovers_to_the_schedule_not_above():
    lr = LRControl()
    snr = SNRGuard(lr, interval=10, current_window=5)
    for step in range(1, 51):
        snr.observe(step, 1.0)
    for step in range(51, 61):  # the norm triples: far outside the band
        snr.observe(step, 3.0)
    assert lr.factor("snr") == pytest.approx(0.8)
    factors = []
    for step in range(61, 201):  # back in band
        snr.observe(step, 1.0)
        factors.append(lr.factor("snr"))
    assert factors[-1] == 1.0 and max(factors) == 1.0  # recovered, never above the schedule
    kinds = [e["kind"] for e in snr.events]
    assert kinds == ["lr_adjusted"] * len(kinds) and len(kinds) >= 3  # one cut, then the steps back up


# --- config and wiring --------------------------------------------------------------------------------------------
def test_guard_config_errors_are_collected_with_their_keys():
    bad = {
        "stability": {
            "guards": {
                "clipping": {"mode": "bogus", "ema_alpha": 2.0},
                "rollback": {"bad_steps": 30, "lr_backoff": 0},
                "thermal": {"cool_c": 80},
                "skip": {"enabled": False},
            }
        }
    }
    with pytest.raises(ConfigError) as err:
        config_from_dict(bad)
    text = "\n".join(err.value.problems)
    for key in (
        "guards.clipping.mode",
        "guards.rollback.bad_steps",
        "guards.rollback.lr_backoff",
        "guards.thermal.cool_c",
        "guards.rollback.enabled",
    ):
        assert key in text, (key, text)
    assert config_from_dict({}).stability.guards.clipping.mode == "adaptive"


def test_build_guards_defaults_and_training_overrides():
    guards = build_guards(GuardsConfig())
    assert [type(g).__name__ for g in guards] == ["SkipGuard", "RollbackGuard", "ClipGuard", "LRControl"]
    assert isinstance(guards[1], RollbackGuard) and guards[1].skip_guard is guards[0]
    assert guards[1].lr_control is guards[-1] and guards[2].skip_guard is guards[0]
    cfg = GuardsConfig()
    with pytest.warns(UserWarning, match="max_grad_norm=1.0 is ignored"):
        assert guard_training_overrides(cfg, {"max_grad_norm": 1.0}) == {"max_grad_norm": 0.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert guard_training_overrides(cfg, {}) == {"max_grad_norm": 0.0}
    cfg.enabled = False
    assert build_guards(cfg) == [] and guard_training_overrides(cfg, {"max_grad_norm": 1.0}) == {}


def test_rollback_check_tells_damaged_weights_from_bad_data():
    from hf_stable.core.rollback_check import Probe, weights_damaged

    skip = SkipGuard(warmup_steps=1)
    for step in range(1, 21):  # references: grad norm ~1, loss ~2
        skip.decide(step, [0, 0, 0, 0], 1.0, 2.0 + 0.01 * (step % 3))
    nan = float("nan")
    judge = skip.local_flags
    # a real step with a 20x gradient, reproduced by the re-run at the current weights (scale 1)
    assert weights_damaged(20.0, 2.1, Probe(20.0, 2.1), Probe(1.1, 2.0), judge)  # fine at the snapshot: weights
    assert not weights_damaged(20.0, 2.1, Probe(20.0, 2.1), Probe(18.0, 2.2), judge)  # as bad there: data
    assert not weights_damaged(1.0, 6.0, Probe(1.0, 6.0), Probe(1.0, 5.8), judge)  # a garbage batch stays a spike
    # the Trainer's scale differs from the re-run's (e.g. gradient averaging over 4 ranks): calibrated by `now`
    assert weights_damaged(20.0, 2.1, Probe(80.0, 8.4), Probe(4.4, 8.0), judge)
    assert not weights_damaged(20.0, 2.1, Probe(80.0, 8.4), Probe(72.0, 8.8), judge)
    # non-finite: reproduced now and gone at the snapshot = damaged; still there = data; not reproduced = transient
    assert weights_damaged(nan, nan, Probe(nan, nan), Probe(1.0, 2.0), judge)
    assert not weights_damaged(nan, nan, Probe(nan, nan), Probe(nan, nan), judge)
    assert not weights_damaged(nan, nan, Probe(1.0, 2.0), Probe(1.0, 2.0), judge)
    assert weights_damaged(20.0, 2.1, Probe(0.0, 2.1), Probe(1.0, 2.0), judge) is None  # no scale: cannot tell
    # ... unless the last accepted batch is still finite at the current weights: healthy weights, an input overflows
    assert not weights_damaged(nan, nan, Probe(nan, nan), Probe(1.0, 2.0), judge, recent=Probe(1.1, 2.1))
    assert weights_damaged(nan, nan, Probe(nan, nan), Probe(1.0, 2.0), judge, recent=Probe(nan, nan))


def _feed(skip, losses, norms, start=1):
    """Decide steps from `start` on with these (loss, grad norm) pairs; the steps skipped."""
    skipped = []
    for step, (loss, norm) in enumerate(zip(losses, norms, strict=True), start):
        if skip.decide(step, skip.local_flags(norm, loss), norm, loss).skip:
            skipped.append(step)
    return skipped


def _noisy(n, level, log_sd, seed):
    rng = random.Random(seed)
    return [level * math.exp(rng.gauss(0, log_sd)) for _ in range(n)]


def test_skip_rules_are_calibrated_to_the_runs_own_noise():
    # batch 1: one record per step, so the step loss spreads like records do (log sd 0.35, as in the embedded
    # recipe's clean batch-1 runs: hard records at 2-3x the median) and the grad norm more (log sd 0.6)
    losses, norms = _noisy(400, 2.3, 0.35, seed=1), _noisy(400, 9.0, 0.6, seed=2)
    assert _feed(SkipGuard(), losses, norms) == []  # healthy training is left alone
    # the same trace with the rise judged by its margin alone (no noise estimate) is skipped here and there
    assert len(_feed(SkipGuard(loss_rise_zscore=None), losses, norms)) >= 4
    # ... while what no noise explains is still caught at that noise: a 20x loss, a 40x gradient, a sustained rise
    skip = SkipGuard()
    _feed(skip, losses[:200], norms[:200])
    assert skip.local_flags(9.0, 2.3 * 20) == [0, 0, 1, 0]
    assert skip.local_flags(9.0 * 40, 2.3) == [0, 1, 0, 0]
    rising = _feed(skip, [6.0 * x for x in losses[200:212]], norms[200:212], start=201)
    assert len(rising) >= 4 and {r for e in skip.events[-len(rising) :] for r in e["reasons"]} == {"loss_rise"}
    event = skip.events[-1]
    assert event["noise"]["rise_sigma"] > 0 and "sd of its noise" in event["message"]
    # batch 8: the step loss averages 8 records (log sd 0.05): a 2.2x batch is a spike, a 1.6x level a rise
    skip = SkipGuard()
    assert _feed(skip, _noisy(100, 1.6, 0.05, seed=3), _noisy(100, 1.0, 0.1, seed=4)) == []
    assert skip.local_flags(1.0, 1.6 * 2.2) == [0, 0, 1, 0]
    assert _feed(skip, [1.6 * 1.6] * 6, [1.0] * 6, start=101)[-3:] == [104, 105, 106]


def test_rollback_evidence_is_a_paired_comparison_over_several_batches():
    from hf_stable.core.rollback_check import Probe, weights_damaged

    skip = SkipGuard()
    _feed(skip, _noisy(60, 2.3, 0.35, seed=5), _noisy(60, 9.0, 0.6, seed=6))
    judge = skip.local_flags
    # batch 1: a rise skipped on a hard record; re-run with 4 accepted steps' batches, the snapshot is a little
    # better (older weights, one record it happened to fit better) - noise, not damage: declined
    assert weights_damaged(12.0, 6.0, Probe(30.0, 14.0), Probe(29.0, 13.3), judge, margin=0.1) is False
    # the same numbers without the margin would have restored (the former single-batch rule's verdict)
    assert weights_damaged(12.0, 6.0, Probe(30.0, 14.0), Probe(29.0, 13.3), judge, margin=0.0) is True
    # damaged weights: the snapshot does clearly better on the same batches (loss 40 % lower, or gradient halved)
    assert weights_damaged(12.0, 6.0, Probe(30.0, 14.0), Probe(20.0, 8.4), judge, margin=0.1) is True
    assert weights_damaged(60.0, 2.3, Probe(200.0, 11.0), Probe(40.0, 10.8), judge, margin=0.1) is True
    # as bad at the snapshot (a garbage batch reproduces its loss at any weights): data, never a rollback
    assert weights_damaged(12.0, 6.0, Probe(30.0, 14.0), Probe(31.0, 14.2), judge, margin=0.1) is False


def test_a_grad_spike_before_the_noise_estimate_exists_is_reported_without_one():
    # warm (3 accepted steps) but only 3 norms: the ratio rule decides alone; the event still says what it compared
    skip = SkipGuard()
    _feed(skip, [2.0, 2.1, 1.9], [1.0, 1.1, 0.9])
    skip._norms.clear()  # as right after a reference reset
    verdict = skip.decide(4, skip.local_flags(50.0, 2.0), 50.0, 2.0)
    assert verdict.reasons == ["grad_spike"] and "grad_z" not in skip.events[-1]["noise"]


def test_a_log_window_gives_the_logs_taken_on_demand_through_fill_overflow_and_bad_values():
    """The skip guard's and loss monitor's windows keep each value's log as it arrives: at every point the logs are
    the floats `math.log` gives on demand (None while a value <= 0 or NaN is inside), after copies and a clear."""
    import copy
    import math
    import pickle

    import pytest

    from hf_stable.core.step_noise import LogWindow, logs_of

    def on_demand(values):
        values = list(values)
        return [math.log(x) for x in values] if all(x > 0 for x in values) else None

    rng = random.Random(0)
    window = LogWindow(maxlen=5)
    assert logs_of(window) == []
    values = [rng.uniform(0.1, 9.0) for _ in range(12)] + [0.0] + [rng.uniform(0.1, 9.0) for _ in range(3)]
    values += [math.nan] + [rng.uniform(0.1, 9.0) for _ in range(6)] + [-1.0]
    seen_none = seen_back = False
    for i, x in enumerate(values):
        window.append(x)
        assert len(window) == min(i + 1, 5) and window[-1] is x
        got = logs_of(window)
        assert got == on_demand(window)
        seen_none |= got is None
        seen_back |= seen_none and got is not None  # the bad value fell out of the window: logs again
    assert seen_none and seen_back
    for clone in (copy.copy(window), copy.deepcopy(window), pickle.loads(pickle.dumps(window)), LogWindow(window, 5)):
        assert isinstance(clone, LogWindow) and list(clone) == list(window) and logs_of(clone) == on_demand(window)
    window.clear()
    window.append(2.0)
    assert logs_of(window) == [math.log(2.0)]
    with pytest.raises(TypeError):
        window.popleft()
