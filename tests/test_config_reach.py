"""Every setting of `stability`, `attention` and `doctor_checks` reaches the object that uses it (issue 15 item 1).

The walk goes over the dataclass fields, so a field added later without a consumer fails here: each field gets a
value other than its default, the recipe's builders run, and the test finds the value on the object that acts on
it (for the callbacks: the very config object, and the attribute the callback reads).
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from hf_stable.attention.settings import AttentionSettings
from hf_stable.callbacks import build_callbacks
from hf_stable.callbacks.builder import build_attention_callbacks
from hf_stable.callbacks.guards.accumulation_control import AccumulationControl
from hf_stable.callbacks.guards.qk_clip_callback import QKClipCallback
from hf_stable.callbacks.monitors.attention_monitor_callback import AttentionMonitorCallback
from hf_stable.config import RunConfig
from hf_stable.config.attention import AttentionConfig
from hf_stable.config.doctor import DoctorConfig
from hf_stable.config.guards import GuardsConfig
from hf_stable.config.stability import MonitorsConfig
from hf_stable.doctor.gradients import group_statistics
from hf_stable.doctor.hazards import check_fp16_family
from hf_stable.doctor.settings import doctor_settings
from hf_stable.optim.phases import wrap_for_phases


def _changed(owner, f: dataclasses.Field):
    """A value of field `f` that differs from its default (validity does not matter: nothing validates here)."""
    value = getattr(owner, f.name)
    hint = typing.get_type_hints(type(owner))[f.name]
    literal = [a for a in typing.get_args(hint) if isinstance(a, str)] or (
        list(typing.get_args(hint)) if typing.get_origin(hint) is typing.Literal else []
    )
    if literal:
        return next(a for a in literal if a != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 3 + 1
    if value is None:
        return 7 if int in typing.get_args(hint) else 0.37
    if isinstance(value, dict):
        return {k: v / 2 for k, v in value.items()}
    if isinstance(value, list):
        return value[:1] if len(value) > 1 else [*value, *value]
    if isinstance(value, str):
        return value + "_x"
    raise AssertionError(f"no changed value for {type(owner).__name__}.{f.name}")


def _sections(group):
    return [
        (f.name, getattr(group, f.name))
        for f in dataclasses.fields(group)
        if dataclasses.is_dataclass(getattr(group, f.name))
    ]


def _stability_cases():
    for master in (MonitorsConfig(), GuardsConfig()):
        for name, section in _sections(master):
            for f in dataclasses.fields(section):
                yield pytest.param(type(master).__name__, name, f.name, id=f"{name}.{f.name}")


def _recipe(master: str, section: str, field: str):
    cfg = RunConfig()
    cfg.training = {**cfg.training, "gradient_accumulation_steps": 4}
    group = cfg.stability.monitors if master == "MonitorsConfig" else cfg.stability.guards
    sec = getattr(group, section)
    if hasattr(sec, "enabled"):
        sec.enabled = True
    if section == "rollback":
        group.skip.enabled = True
    f = next(x for x in dataclasses.fields(sec) if x.name == field)
    value = _changed(sec, f)
    setattr(sec, field, value)
    return cfg, sec, value


@pytest.mark.parametrize(("master", "section", "field"), list(_stability_cases()))
def test_every_stability_field_reaches_its_callback(master, section, field):
    cfg, sec, value = _recipe(master, section, field)
    callbacks = build_callbacks(cfg)
    owners = [cb for cb in callbacks if getattr(cb, "config", None) is sec]
    if field == "enabled":  # switched off: the builder leaves the callback out
        assert not owners
        return
    if (
        section == "batch_warmup"
        and field in ("target_accumulation", "lr_rule")
        or (section == "thermal" and field == "lr_rule")
    ):  # read by the accumulation controller the two guards share
        acc = next(cb for cb in callbacks if isinstance(cb, AccumulationControl))
        assert (acc.target if field == "target_accumulation" else acc.lr_rule) == value
        return
    assert len(owners) == 1, [type(cb).__name__ for cb in callbacks]
    (owner,) = owners
    if section == "phases" and field == "state_policy":  # the optimizer wrapper's setting, not the guard's
        first = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
        assert wrap_for_phases(first, sec).state_policy == value
        return
    assert getattr(owner, field) == value  # group_max_norm: every site overridden, so the merge is the value


def test_guards_and_monitors_master_switches():
    cfg = RunConfig()

    def kinds():
        return {type(cb).__module__.split(".")[2] for cb in build_callbacks(cfg)}

    assert {"monitors", "guards"} <= kinds()
    cfg.stability.monitors.enabled = False
    cfg.attention.monitor_interval = 0  # the attention monitor is the attention section's
    assert "monitors" not in kinds() and "guards" in kinds()
    cfg.stability.guards.enabled = False
    assert "guards" not in kinds()


def _attention(field: str):
    cfg = AttentionConfig(qk_clip=True)
    f = next(x for x in dataclasses.fields(cfg) if x.name == field)
    value = _changed(cfg, f)
    setattr(cfg, field, value)
    return cfg, value


ATTENTION_READERS = {
    "monitor_interval": (AttentionMonitorCallback, "interval"),
    "logit_alert_threshold": (AttentionMonitorCallback, "alert_threshold"),
    "logit_growth_checks": (AttentionMonitorCallback, "growth_checks"),
    "logit_growth_ratio": (AttentionMonitorCallback, "growth_ratio"),
    "logit_growth_min_share": (AttentionMonitorCallback, "growth_min_share"),
    "qk_clip_tau": (QKClipCallback, "tau"),
    "qk_clip_alpha": (QKClipCallback, "alpha"),
    "qk_clip_interval": (QKClipCallback, "interval"),
    "qk_clip_on_lora": (QKClipCallback, "on_lora"),
}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(AttentionConfig)])
def test_every_attention_field_reaches_its_user(field):
    if field in ("backend", "softcap"):  # the attention function's process-wide settings
        cfg = AttentionConfig(backend="eager") if field == "softcap" else AttentionConfig()
        value = 30.0 if field == "softcap" else "flash"
        setattr(cfg, field, value)
        assert getattr(AttentionSettings.from_config(cfg), field) == value
        return
    cfg, value = _attention(field)
    built = build_attention_callbacks(cfg)
    if field == "implementation":  # another implementation: nothing to monitor or clip
        assert built == []
        return
    if field == "qk_clip":  # switched off: only the monitor remains
        assert [type(cb) for cb in built] == [AttentionMonitorCallback]
        return
    cls, attribute = ATTENTION_READERS[field]  # a new field needs a line here (and a reader)
    (owner,) = [cb for cb in built if isinstance(cb, cls)]
    assert owner.config is cfg and getattr(owner, attribute) == value


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(DoctorConfig)])
def test_every_doctor_field_reaches_the_doctor(field):
    """From the recipe's `doctor_checks:` to the settings object `run_doctor` hands every check."""
    cfg = RunConfig()
    f = next(x for x in dataclasses.fields(DoctorConfig) if x.name == field)
    value = _changed(cfg.doctor_checks, f)
    setattr(cfg.doctor_checks, field, value)
    settings = doctor_settings(cfg)
    assert settings is cfg.doctor_checks and getattr(settings, field) == value


def test_doctor_thresholds_change_the_verdicts():
    rows = [{"norms": [1e-5, 1.0]}, {"norms": [1e-5, 3.0]}]  # group a: tiny; group b: mean 2, std 1
    _, default = group_statistics(rows, ["a", "b"], DoctorConfig())
    _, loose = group_statistics(rows, ["a", "b"], DoctorConfig(grad_mean_min=1e-6, grad_cv_max=0.9))
    assert sorted(f.severity for f in default) == ["info", "warning"]  # a: mean too low; b: noisy (info)
    assert [f.severity for f in loose] == ["ok"]

    class Facts:
        model_type = "llama"

    cfg = RunConfig()
    s = type("S", (), {"fp16": True})()  # the TrainingSettings field the check reads
    assert not check_fp16_family(cfg, s, Facts(), DoctorConfig())
    assert check_fp16_family(cfg, s, Facts(), DoctorConfig(fp16_overflow_families=["llama"]))
