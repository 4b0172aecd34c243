"""The doctor's quick checks at recipe start: one WARNING line per config hazard, the doctor's words, silent on the
default recipe."""

from __future__ import annotations

import logging

from hf_stable.callbacks.guards import guard_training_overrides
from hf_stable.config import load_config, training_arguments
from hf_stable.doctor.quick_checks import warn_quick_checks


def _cfg_args(*argv):
    cfg = load_config(argv=list(argv))
    overrides = guard_training_overrides(cfg.stability.guards, cfg.training)
    return cfg, training_arguments(cfg, remove_unused_columns=False, **overrides)


def test_default_recipe_has_no_quick_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert warn_quick_checks(*_cfg_args()) == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_lr_far_out_of_range_is_one_warning_line_in_the_doctors_words(caplog):
    from hf_stable.doctor.hazards import check_hazards
    from hf_stable.doctor.settings import doctor_settings, resolve_settings

    cfg, args = _cfg_args("--training.learning_rate", "1.0")
    doctor_row = next(
        f for f in check_hazards(cfg, resolve_settings(cfg, args), doctor_settings(cfg)) if f.severity == "warning"
    )
    lines = warn_quick_checks(cfg, args)
    assert lines == [f"doctor: {doctor_row.what} ({doctor_row.evidence}); {doctor_row.fix}"]
    assert (
        lines[0].startswith("doctor: learning rate 1 is far above the usual range for adamw")
        and "try <= 0.003" in lines[0]
    )
