"""Every monitor alert fires on a constructed trace and stays silent on a healthy one (no Trainer needed)."""

from __future__ import annotations

import math
import random

import pytest

from hf_stable.callbacks.monitors import EVENT_KINDS, build_monitors
from hf_stable.callbacks.monitors.gradient_monitor import GradientMonitor
from hf_stable.callbacks.monitors.hardware_monitor import HardwareMonitor
from hf_stable.callbacks.monitors.loss_monitor import LossMonitor
from hf_stable.callbacks.monitors.memory_monitor import MemoryMonitor
from hf_stable.callbacks.monitors.throughput_monitor import ThroughputMonitor
from hf_stable.callbacks.monitors.update_monitor import UpdateMonitor
from hf_stable.config import MonitorsConfig, load_config
from hf_stable.core.events import read_events
from hf_stable.core.grad_stats import GradReport
from hf_stable.errors import ConfigError


def _bind(cb, tmp_path):
    cb._output_dir = str(tmp_path)
    return cb


def _kinds(tmp_path):
    return [e["kind"] for e in read_events(tmp_path)]


def _grad(norm, max_abs=0.1, group="layer_0", param="model.layers.0.mlp.up_proj.weight"):
    return GradReport(
        step=0,
        available=True,
        global_norm=norm,
        group_norms={group: norm, "embeddings": norm / 2},
        nonfinite={group: 0},
        max_abs=max_abs,
        max_abs_group=group,
        max_abs_param=param,
    )


def _healthy_losses(n, seed=0):
    rng = random.Random(seed)
    return [2.0 + 3.0 * math.exp(-i / 30) + rng.gauss(0, 0.05) for i in range(n)]


# --- gradients -----------------------------------------------------------------------------------------------
def test_grad_alerts_fire_on_constructed_traces(tmp_path):
    mon = _bind(GradientMonitor(), tmp_path)
    for step in range(1, 6):
        mon.observe(step, _grad(1.0 + 0.1 * step))
    mon.observe(6, _grad(3e4))  # explosion
    mon.observe(7, _grad(2.0, max_abs=4e3, group="embeddings", param="model.embed_tokens.weight"))
    for step in range(8, 8 + 10):
        mon.observe(step, _grad(1e-8))  # vanishing: fires on the 10th consecutive check
    events = read_events(tmp_path)
    assert [e["kind"] for e in events] == ["grad_explosion", "grad_max_abs", "grad_vanishing"]
    assert events[0]["step"] == 6 and events[0]["value"] == 3e4 and events[0]["threshold"] == 1e4
    assert events[1]["group"] == "embeddings" and events[1]["param"] == "model.embed_tokens.weight"
    assert events[2]["step"] == 17
    for key in ("step", "kind", "group", "value", "threshold", "message"):
        assert key in events[0]


def test_grad_vanishing_needs_consecutive_checks_and_healthy_is_silent(tmp_path):
    mon = _bind(GradientMonitor(), tmp_path)
    for step in range(1, 40):  # 9 tiny, 1 normal, repeat: never 10 in a row
        mon.observe(step, _grad(1e-8 if step % 10 else 0.5))
    rng = random.Random(0)
    for step in range(40, 300):
        mon.observe(step, _grad(abs(rng.gauss(1.0, 0.3)) + 1e-3, max_abs=abs(rng.gauss(0, 0.05))))
    assert _kinds(tmp_path) == []


def test_repeated_alert_is_rate_limited(tmp_path):
    mon = _bind(GradientMonitor(cooldown_steps=50), tmp_path)
    for step in range(1, 61):
        mon.observe(step, _grad(2e4))
    events = read_events(tmp_path)
    assert [e["step"] for e in events] == [1, 51]
    assert "49 similar alerts suppressed" in events[1]["message"]


# --- loss ----------------------------------------------------------------------------------------------------
def test_loss_spike_fires_and_healthy_noisy_decay_is_silent(tmp_path):
    mon = _bind(LossMonitor(), tmp_path)
    losses = _healthy_losses(200)
    for step, loss in enumerate(losses, 1):
        mon.observe_loss(step, loss)
    assert _kinds(tmp_path) == []  # includes the fast convex early descent: no curvature alert
    mon.observe_loss(201, losses[-1] + 1.5)
    events = read_events(tmp_path)
    assert [e["kind"] for e in events] == ["loss_spike"] and events[0]["step"] == 201
    assert events[0]["zscore"] > 6


def test_loss_spike_off_a_logging_step_fires_the_same_and_its_z_score_is_logged_only_when_due(tmp_path):
    """Off a logging step the monitor measures the z-score only for a loss large enough to be a spike: the same alert
    as when every step is measured, the same z at a logging step, and no z-score metric otherwise."""
    every, lazy = _bind(LossMonitor(), tmp_path / "every"), _bind(LossMonitor(), tmp_path / "lazy")
    losses = _healthy_losses(200)
    for step, loss in enumerate(losses, 1):
        every.observe_loss(step, loss)
        lazy._pending.clear()
        lazy.observe_loss(step, loss, metrics_due=step % 10 == 0)
        if step % 10 == 0 and step > 20:
            assert lazy._pending["loss/zscore"] == every._pending["loss/zscore"]
        elif step > 20:
            assert "loss/zscore" not in lazy._pending and lazy._pending["loss/train"] == loss
    spike = losses[-1] + 1.5
    every.observe_loss(201, spike)
    lazy.observe_loss(201, spike, metrics_due=False)
    got, want = read_events(tmp_path / "lazy"), read_events(tmp_path / "every")
    assert [e["kind"] for e in got] == [e["kind"] for e in want] == ["loss_spike"]
    assert got[0]["zscore"] == want[0]["zscore"] > 6 and lazy._pending["loss/zscore"] == got[0]["zscore"]


def test_loss_curvature_rule_fires_on_accelerating_rise(tmp_path):
    mon = _bind(LossMonitor(spike_zscore=1e9), tmp_path)
    for step in range(1, 21):
        mon.observe_loss(step, 2.0)
    for i, step in enumerate(range(21, 31), 1):
        mon.observe_loss(step, 2.0 + 0.08 * i * i)  # second difference 0.16 > 0.1, rising
    events = read_events(tmp_path)
    assert [e["kind"] for e in events] == ["loss_curvature"]
    assert events[0]["step"] == 26 and events[0]["value"] == pytest.approx(0.16)


def test_loss_curvature_interval_means(tmp_path):
    mon = _bind(LossMonitor(spike_zscore=1e9, curvature_interval=4), tmp_path)
    for i in range(1, 9 * 4 + 1):
        mon.observe_loss(i, 1.0 + 0.2 * (i // 4) ** 2)  # interval means accelerate: 0.4 curvature per check
    assert _kinds(tmp_path) == ["loss_curvature"]


def test_nonfinite_loss_is_not_learned_from(tmp_path):
    mon = _bind(LossMonitor(), tmp_path)
    for step, loss in enumerate(_healthy_losses(50), 1):
        mon.observe_loss(step, loss)
    mon.observe_loss(51, float("nan"))
    assert all(math.isfinite(x) for x in mon.state_dict()["history"])


def test_plateau_fires_once_and_stops_training(tmp_path):
    from transformers import TrainerControl

    mon = _bind(LossMonitor(plateau_window=200), tmp_path)
    for step, value in ((100, 1.5), (200, 1.2), (300, 1.11), (400, 1.0995), (500, 1.0991)):
        assert mon.observe_eval(step, value) == []
    control = TrainerControl()
    args = state = None
    mon.on_evaluate(args, type("S", (), {"global_step": 600})(), control, metrics={"eval_loss": 1.0993})
    events = read_events(tmp_path)
    assert [e["kind"] for e in events] == ["loss_plateau"] and events[0]["step"] == 600
    assert control.should_training_stop
    assert mon.observe_eval(700, 1.0992) == [] and state is None  # fires once


def test_plateau_silent_while_improving(tmp_path):
    mon = _bind(LossMonitor(plateau_window=200), tmp_path)
    for i, step in enumerate(range(50, 2000, 50)):
        mon.observe_eval(step, 2.0 * math.exp(-i / 20))
    assert _kinds(tmp_path) == []


# --- updates ---------------------------------------------------------------------------------------------------
def test_update_stall_fires_per_group_and_healthy_is_silent(tmp_path):
    mon = _bind(UpdateMonitor(patience=3), tmp_path)
    for step in range(10, 100, 10):
        mon.observe(step, {"layer_0": 1e-3, "lm_head": 2e-3}, {"layer_0": 0.5, "lm_head": 0.4})
    assert _kinds(tmp_path) == []
    for step in range(100, 130, 10):  # lm_head stops moving, layer_0 does not; zero-grad group not judged
        mon.observe(step, {"layer_0": 1e-3, "lm_head": 0.0, "norm": 0.0}, {"layer_0": 0.5, "lm_head": 0.4, "norm": 0})
    events = read_events(tmp_path)
    assert [(e["kind"], e["group"], e["step"]) for e in events] == [("update_stall", "lm_head", 120)]


# --- memory ----------------------------------------------------------------------------------------------------
def _mem(reserved, allocated=None, retries=0, ooms=0, rss=1.0):
    return {
        "allocated": allocated if allocated is not None else reserved * 0.8,
        "reserved": reserved,
        "peak": reserved * 0.9,
        "retries": retries,
        "ooms": ooms,
        "rss": rss,
    }


def test_memory_leak_retries_and_oom_fire(tmp_path):
    mon = _bind(MemoryMonitor(leak_window=10, warmup_steps=0), tmp_path)
    for i in range(10):
        mon.observe(10 * (i + 1), _mem(4.0 + 0.1 * i))  # +0.9 GiB, every sample up
    mon.observe(110, _mem(5.0, retries=3))
    mon.observe(120, _mem(5.1, retries=3, ooms=1))
    kinds = _kinds(tmp_path)
    assert kinds == ["memory_leak", "alloc_retries", "oom"]
    assert mon._pending["mem/fragmentation"] == pytest.approx((5.1 - 5.1 * 0.8) / 5.1)


def test_memory_healthy_sawtooth_and_cpu_rss_silent(tmp_path):
    mon = _bind(MemoryMonitor(leak_window=10, warmup_steps=0), tmp_path)
    for i in range(60):
        mon.observe(10 * (i + 1), _mem(4.0 + (0.3 if i % 3 == 0 else 0.0) + 0.001 * (i % 5)))
    nan = float("nan")
    for i in range(60, 90):  # CPU: only RSS, flat with noise
        mon.observe(
            10 * (i + 1),
            {"allocated": nan, "reserved": nan, "peak": nan, "retries": nan, "ooms": nan, "rss": 1.0 + 0.01 * (i % 2)},
        )
    assert _kinds(tmp_path) == []
    assert set(mon._pending) == {
        "mem/rss_gib",
        "mem/allocated_gib",
        "mem/reserved_gib",
        "mem/peak_gib",
        "mem/alloc_retries",
        "mem/ooms",
        "mem/fragmentation",
    }


def test_cpu_rss_leak(tmp_path):
    nan = float("nan")
    mon = _bind(MemoryMonitor(leak_window=5, warmup_steps=20, leak_min_growth_gib=0.1), tmp_path)
    for i in range(12):
        mon.observe(
            10 * i,
            {"allocated": nan, "reserved": nan, "peak": nan, "retries": nan, "ooms": nan, "rss": 1.0 + 0.05 * i},
        )
    events = read_events(tmp_path)
    assert [e["kind"] for e in events] == ["memory_leak"] and "RSS" in events[0]["message"]
    assert events[0]["step"] == 60  # samples before warmup_steps are ignored


# --- throughput and hardware -------------------------------------------------------------------------------------
def test_data_stall_mild_and_severe_and_healthy_silent(tmp_path):
    mon = _bind(ThroughputMonitor(cooldown_steps=0), tmp_path)
    mon.observe(10, tokens=10_000, wait_s=0.5, compute_s=5.0, steps=10)
    assert _kinds(tmp_path) == []
    assert mon._pending["perf/tokens_per_s"] == pytest.approx(10_000 / 5.5)
    mon.observe(20, tokens=10_000, wait_s=7.0, compute_s=5.0, steps=10)  # 1.4: mild
    mon.observe(30, tokens=10_000, wait_s=15.0, compute_s=5.0, steps=10)  # 3.0: severe
    mon.observe(40, tokens=100, wait_s=15.0, compute_s=5.0, steps=2)  # too few steps to judge
    events = read_events(tmp_path)
    assert [(e["kind"], e["severity"]) for e in events] == [("data_stall", "warning"), ("data_stall", "error")]


def test_gpu_hot(tmp_path):
    mon = _bind(HardwareMonitor(temp_alert_c=80), tmp_path)
    mon.observe(5, {"hw/gpu_temp_c": 70.0, "hw/power_w": 300.0})
    mon.observe(6, {"hw/gpu_temp_c": 83.0})
    assert _kinds(tmp_path) == ["gpu_hot"] and mon._pending["hw/power_w"] == 300.0


# --- config and factory ------------------------------------------------------------------------------------------
def test_build_monitors_follows_config_and_every_kind_is_documented():
    cfg = MonitorsConfig()
    names = [type(cb).__name__ for cb in build_monitors(cfg)]
    assert names == [
        "GradientMonitor",
        "NonFiniteLocator",
        "LossMonitor",
        "UpdateMonitor",
        "MemoryMonitor",
        "ThroughputMonitor",
        "HardwareMonitor",
        "ReplicaCheck",
    ]
    cfg.update.enabled = False
    cfg.grad.explosion_norm = 123.0
    built = build_monitors(cfg)
    assert "UpdateMonitor" not in [type(cb).__name__ for cb in built] and built[0].explosion_norm == 123.0
    cfg.enabled = False
    assert build_monitors(cfg) == []
    documented = {"grad_explosion", "nonfinite_grad", "loss_spike", "memory_leak", "data_stall", "replica_mismatch"}
    assert documented <= set(EVENT_KINDS)


def test_config_from_yaml_overrides_and_validation():
    cfg = load_config(
        None, ["--stability.monitors.loss.spike_zscore", "4.5", "--stability.monitors.grad.max_abs", "1e2"]
    )
    assert cfg.stability.monitors.loss.spike_zscore == 4.5 and cfg.stability.monitors.grad.max_abs == 100.0
    with pytest.raises(ConfigError) as err:
        load_config(
            None, ["--stability.monitors.grad.every_n_steps", "0", "--stability.monitors.throughput.mild_ratio", "3.0"]
        )
    text = str(err.value)
    assert "stability.monitors.grad.every_n_steps: got 0" in text
    assert "stability.monitors.throughput.mild_ratio" in text
