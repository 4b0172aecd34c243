"""What the rescue benchmark reports a run said (benchmarks/rescue_said.py, rescue_harness.event_summary): the events
per kind with their highest severity, the verdict of the library's rule, and the before/after table that flags an
event kind a fault case no longer raises."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


@pytest.fixture
def said(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    return pytest.importorskip("rescue_said")


def _run(case, arm, seed, events, ratio=1.0, verdict="rescued", skips=0):
    return {
        "case": case,
        "arm": arm,
        "seed": seed,
        "events": events,
        "stability": verdict,
        "ratio": ratio,
        "skips": skips,
        "rollbacks": 0,
        "lr_factor": 1.0,
    }


def test_event_summary_keeps_the_highest_severity_and_judges_with_the_verdict_rule(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    harness = pytest.importorskip("rescue_harness")
    events = [
        {"kind": "nonfinite_grad", "severity": "warning", "step": 3},
        {"kind": "nonfinite_grad", "severity": "error", "step": 9},
        {"kind": "step_skipped", "severity": "info", "step": 3},
    ]
    history = [{"step": 10, "loss": 1.5}]
    out = harness.event_summary(events, history)
    assert out["kinds"] == {"nonfinite_grad": [2, "error"], "step_skipped": [1, "info"]}
    assert out["verdict"] == "rescued"
    quiet = harness.event_summary([{"kind": "attn_logit_high", "severity": "warning", "step": 10}], history)
    assert quiet["verdict"] == "warned"
    assert harness.event_summary([], history) == {"kinds": {}, "verdict": "healthy"}


def test_compare_flags_a_fault_case_that_lost_an_event_kind(said, tmp_path):
    before = [
        _run("nan", "hf_stable", 0, {"nonfinite_grad": [3, "warning"], "step_skipped": [3, "info"]}, 1.004),
        _run("lr_10x", "hf_stable", 0, {"rollback": [2, "warning"], "step_skipped": [6, "info"]}, 1.016),
        _run("nan", "plain", 0, None, math.inf),  # peers write no events: left out
    ]
    after = [
        _run("nan", "hf_stable", 0, {"nonfinite_grad": [3, "warning"], "step_skipped": [3, "info"]}, 1.004),
        _run("lr_10x", "hf_stable", 0, {"step_skipped": [6, "info"]}, 1.020, verdict="diverged"),
    ]
    paths = []
    for label, results in (("before", before), ("after", after)):
        paths.append(tmp_path / f"{label}.json")
        said.write_json(str(paths[-1]), results, {"label": label, "hf_stable": f"/{label}/hf_stable"})
    assert json.loads(paths[0].read_text())["results"][2]["ratio"] == math.inf  # JSON keeps inf as Infinity
    lines = said.compare(said.read_json(str(paths[0])), said.read_json(str(paths[1])))
    rows = [line for line in lines if line.startswith("| ") and "hf_stable" in line]
    assert len(rows) == 2 and "(lost: rollback)" in rows[0] and "lost" not in rows[1]  # lr_10x sorts first (CASES)
    assert "1.016 | 1.020 | rescued -> diverged" in rows[0]
    assert lines[-1] == "rows=2 kept_every_event_kind=1/2 rows_with_changed_kinds=1"
    table = said.events_table(after)
    assert "lr_x" in table[0] and table[2].endswith(
        "rescued       0     0       1  nonfinite_grad x3!, step_skipped x3"
    )
