"""The end of a run never crashes on its own report: every plot and table copes with NaN, inf, empty and one-point
series (a rescued run logs exactly those), and a failure there is one line while run_summary.json is still written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_stable.reporting import posttrain_plots, stability_plots
from hf_stable.reporting.report import _glance, render_report
from hf_stable.reporting.suspect_data import plot_bad_step_losses, suspect_table

VALUES = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-300, 1e300]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
)
KEYS = [
    "loss",
    "loss/train",
    "eval_loss",
    "learning_rate",
    "grad/norm_global",
    "grad_norm",
    "grad/norm/embeddings",
    "grad/norm/layer_0.attn",
    "mem/rss_gib",
    "mem/fragmentation",
    "perf/tokens_per_s",
    "posttrain/reward",
    "posttrain/kl",
    "posttrain/entropy",
    "posttrain/completions/mean_length",
    "posttrain/rewards/margins",
    "posttrain/logps/chosen",
    "posttrain/rewards/accuracies",
]


@st.composite
def histories(draw):
    """0-4 logged steps, each with any subset of the keys, each value anything a diverged run can log."""
    rows = []
    for step in range(1, draw(st.integers(0, 4)) + 1):
        keys = draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=len(KEYS)))
        rows.append({"step": step, **{k: draw(VALUES) for k in keys}})
    return rows


@st.composite
def forensics_events(draw):
    """step_forensics events whose per-sample losses and ratios are NaN/inf/0/ordinary (a NaN forward: all NaN)."""
    events = []
    for step in draw(st.lists(st.integers(1, 50), unique=True, max_size=3)):
        samples = [
            [f"train.jsonl:{i}", draw(VALUES), draw(VALUES), draw(VALUES)] for i in range(draw(st.integers(0, 3)))
        ]
        healthy = draw(st.lists(VALUES, max_size=3))
        events.append(
            {"kind": "step_forensics", "step": step, "severity": "warning", "samples": samples, "healthy": healthy}
        )
        if samples and draw(st.booleans()):
            events.append(
                {
                    "kind": "samples_quarantined",
                    "step": step,
                    "severity": "warning",
                    "records": [{"where": samples[0][0]}],
                }
            )
    return events


def _check_written(path):
    assert path is None or (Path(path).is_file() and Path(path).stat().st_size > 0)


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(history=histories())
def test_every_plot_and_table_copes_with_nonfinite_empty_and_one_point_series(tmp_path_factory, history):
    out = tmp_path_factory.mktemp("plots")
    events = [{"kind": "loss_spike", "step": 1, "severity": "warning"}]
    _check_written(stability_plots.plot_loss(history, events, out / "loss.png"))
    _check_written(stability_plots.plot_lr(history, out / "lr.png"))
    _check_written(stability_plots.plot_loss_lr(history, out / "loss_lr.png", events=events))
    _check_written(stability_plots.plot_grad_norms(history, events, out / "g.png"))
    _check_written(stability_plots.plot_grad_norms(history, events, out / "g_heat.png", max_lines=0))
    _check_written(stability_plots.plot_memory(history, out / "mem.png"))
    _check_written(posttrain_plots.plot_rl(history, events, out / "rl.png"))
    _check_written(posttrain_plots.plot_preference(history, events, out / "pref.png"))
    _glance(history)


@SETTINGS
@given(events=forensics_events())
def test_bad_step_plot_and_suspect_table_cope_with_nonfinite_losses(tmp_path_factory, events):
    out = tmp_path_factory.mktemp("bad")
    _check_written(plot_bad_step_losses(events, out / "bad.png"))
    entries = [{"step": 1, "where": "f:1", "reason": "r", "evidence": {"loss": math.nan, "z": math.inf}}]
    assert suspect_table(entries)


def test_all_nan_bad_step_is_not_drawn_and_the_report_still_renders(tmp_path):
    """The measured crash: a NaN forward makes every per-sample loss of the step NaN (log axis of nothing)."""
    events = [
        {
            "kind": "step_forensics",
            "step": 150,
            "severity": "warning",
            "samples": [["train.jsonl:3", math.nan, math.nan, math.nan]],
            "healthy": [],
        }
    ]
    assert plot_bad_step_losses(events, tmp_path / "bad.png") is None
    (tmp_path / "stability_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    history = [{"step": 1, "loss/train": math.nan, "grad/norm_global": math.nan, "learning_rate": 1e-4}]
    text = render_report(tmp_path, history)
    assert "### Events" in text


def test_a_failing_plot_is_one_line_and_the_report_still_renders(tmp_path, monkeypatch, caplog):
    def broken(*a, **k):
        raise ValueError("Data cannot be log-scaled because all values are <= 0.")

    monkeypatch.setattr(stability_plots, "plot_memory", broken)
    history = [{"step": 1, "loss/train": 2.0}, {"step": 2, "loss/train": 1.5}]
    text = render_report(tmp_path, history)
    assert "the memory plot could not be drawn (ValueError: Data cannot be log-scaled" in text
    assert "![loss](report/loss.png)" in text


@pytest.mark.parametrize("n", [1, 2])
def test_short_run_loss_lr_plot_labels_its_loss_and_draws_it_over_the_lr(tmp_path, n):
    import matplotlib

    matplotlib.use("Agg")
    history = [{"step": s, "loss": 2.0 - 0.1 * s, "learning_rate": 1e-4} for s in range(1, n + 1)]
    captured = {}
    orig = stability_plots._save

    def keep(fig, path):
        ax = fig.axes[0]
        captured["labels"] = [line.get_label() for line in ax.get_lines()]
        captured["markers"] = [line.get_marker() for line in ax.get_lines()]
        captured["loss_on_top"] = ax.get_zorder() > fig.axes[1].get_zorder()
        return orig(fig, path)

    stability_plots._save, saved = keep, stability_plots._save
    try:
        assert stability_plots.plot_loss_lr(history, tmp_path / "p.png") is not None
    finally:
        stability_plots._save = saved
    assert "train loss (mean over each logging interval)" in captured["labels"]
    assert captured["markers"][0] == "o"  # one or two points stay visible
    assert captured["loss_on_top"]


def test_posttrain_plots_are_drawn_only_when_the_run_has_their_signals(tmp_path):
    """A DPO run's history draws the preference plot and no RL plot (its TRL entropy alone is no RL run); a GRPO
    run's the RL plot, whose KL log axis leaves out the 1e-300 and 0 values; an SFT run's neither. Both end up
    linked in the report."""
    dpo = [
        {
            "step": s,
            "posttrain/rewards/margins": 0.1 * s,
            "posttrain/logps/chosen": -30.0 - s,
            "posttrain/entropy": 5.0,
        }
        for s in range(1, 5)
    ]
    grpo = [{"step": s, "posttrain/reward": 0.5, "posttrain/kl": v} for s, v in enumerate([1e-300, 0.0, 1e9, 2.0], 1)]
    sft = [{"step": 1, "loss": 2.0, "grad_norm": 1.0}]
    events = [{"kind": "margin_runaway", "step": 3, "severity": "warning"}]
    assert posttrain_plots.plot_rl(dpo, events, tmp_path / "a.png") is None
    assert posttrain_plots.plot_preference(dpo, events, tmp_path / "b.png") is not None
    assert posttrain_plots.plot_preference(grpo, events, tmp_path / "c.png") is None
    assert posttrain_plots.plot_rl(grpo, events, tmp_path / "d.png") is not None
    assert posttrain_plots._points(grpo, "kl", log=True) == [(3, 1e9), (4, 2.0)]
    assert posttrain_plots.plot_rl(sft, [], tmp_path / "e.png") is None
    assert posttrain_plots.plot_preference(sft, [], tmp_path / "f.png") is None
    text = render_report(tmp_path / "run", dpo + grpo)
    assert (
        "![RL signals](report/posttrain_rl.png)" in text and "![preference signals](report/posttrain_pref.png)" in text
    )
