"""The preference rules (`PreferenceRules`, in `PostTrainMonitor`): silent on a real clean DPO run that learns
(accuracy 1 from step ~9, margins x5 over the run, the chosen log-probs rising), and each one fires on that run's
own series edited into its fault: the chosen log-probs falling while the margin grows (`likelihood_displacement`),
the margins exploding with accuracy stuck at 1 (`margin_runaway`)."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

import hf_stable
from hf_stable.callbacks.monitors.post_train_monitor import PostTrainMonitor
from hf_stable.callbacks.monitors.preference_rules import ACCURACY, CHOSEN, KEYS, MARGIN, PreferenceRules
from hf_stable.core.events import read_events
from hf_stable.reporting.report import render_report
from tests.dist_scripts.posttrain_common import build_trainer, preference_rows

pytest.importorskip("trl")

STEPS = 64
RULES = ("likelihood_displacement", "margin_runaway")


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A healthy DPO run at a high learning rate and beta 1 (the margins grow fast, accuracy saturates)."""
    out = tmp_path_factory.mktemp("clean_dpo")
    rows = preference_rows(4 * STEPS)
    trainer = build_trainer("dpo", out, data=rows, max_steps=STEPS, learning_rate=1e-2, beta=1.0)
    hf_stable.stabilize(trainer).train()
    series = {k: [h[f"posttrain/{k}"] for h in trainer.state.log_history if f"posttrain/{k}" in h] for k in KEYS}
    return out, series, trainer.state.log_history


def _replay(series: dict[str, list[float]], **kw) -> list[tuple[int, str, str, dict]]:
    rules = PreferenceRules(**kw)
    rules.hints = {"learning_rate": 0.01, "beta": 1.0}
    said = []
    for i in range(len(series[CHOSEN])):
        said += [(i + 1, *e) for e in rules.observe(i + 1, {k: [v[i]] for k, v in series.items()})]
    return said


def test_a_clean_learning_dpo_run_says_nothing(clean_run):
    out, series, _ = clean_run
    assert all(len(v) == STEPS for v in series.values())
    # the run learns: what the rules must tell apart from a fault
    assert min(series[ACCURACY][-32:]) == 1.0 and sum(series[MARGIN][-8:]) > 4 * sum(series[MARGIN][8:16])
    assert sum(series[CHOSEN][-16:]) > sum(series[CHOSEN][:16])
    events = read_events(out)
    assert not [e for e in events if e["kind"] in RULES]
    # no warning about the training (step 0 holds the setup's notices, e.g. the attention monitor being off on sdpa)
    assert not [e for e in events if e["step"] > 0 and e.get("severity") in ("warning", "error")], events
    assert _replay(series) == []


def test_chosen_log_probs_falling_while_the_margin_grows_is_likelihood_displacement(clean_run):
    _, series, _ = clean_run
    faulty = {k: list(v) for k, v in series.items()}
    faulty[CHOSEN] = [v - max(0, i - 24) * 0.3 for i, v in enumerate(series[CHOSEN])]  # down 12 nats by the end
    said = _replay(faulty)
    assert [kind for _, kind, _, _ in said] == ["likelihood_displacement"]  # said once for the stretch
    step, _, message, fields = said[0]
    assert (
        32 < step <= STEPS and fields["fall"] > 0.1 * abs(fields["reference"]) and fields["fall"] > 4 * fields["noise"]
    )
    assert fields["margin"] > fields["margin_ref"]
    assert f"{fields['reference']:.2f}" in message and f"{fields['value']:.2f}" in message
    assert "learning_rate=0.01" in message and "beta=1.0" in message and "loss_type=['sigmoid', 'sft']" in message
    # the same fall with a margin that does not grow is not this event (both log-probs falling alike)
    flat = {**faulty, MARGIN: [series[MARGIN][10]] * STEPS}
    assert not [s for s in _replay(flat) if s[1] == "likelihood_displacement"]


def test_margins_exploding_with_accuracy_stuck_at_one_is_a_margin_runaway(clean_run):
    _, series, _ = clean_run
    faulty = {k: list(v) for k, v in series.items()}
    faulty[MARGIN] = [v * 1.2 ** max(0, i - 40) for i, v in enumerate(series[MARGIN])]
    said = _replay(faulty)
    assert [kind for _, kind, _, _ in said] == ["margin_runaway"]
    step, _, message, fields = said[0]
    assert step > 41 and fields["ratio"] > 4 and fields["accuracy_min"] >= 0.99
    assert f"{fields['ratio']:.1f}x" in message and "loss_type=['sigmoid', 'sft']" in message
    # the same margins while accuracy is still below 1 on some steps: still learning to separate, not a runaway
    unsure = {**faulty, ACCURACY: [0.75 if i % 8 == 0 else a for i, a in enumerate(series[ACCURACY])]}
    assert not [s for s in _replay(unsure) if s[1] == "margin_runaway"]


def test_rules_state_round_trips():
    rules = PreferenceRules(window=4)
    for i in range(6):
        rules.observe(i + 1, {CHOSEN: [-30.0 - i], MARGIN: [0.1 * i], ACCURACY: [1.0]})
    again = PreferenceRules(window=4)
    again.load_state_dict(rules.state_dict())
    assert again.state_dict() == rules.state_dict()


def test_the_report_draws_the_runs_preference_signals(clean_run):
    out, _, history = clean_run
    text = render_report(out, history)
    assert "![preference signals](report/posttrain_pref.png)" in text and "RL signals" not in text
    assert (out / "report" / "posttrain_pref.png").stat().st_size > 0


class ChosenFalls(TrainerCallback):
    """A fault in what TRL computed: from step `start` on, the chosen log-probs TRL appended for the step are lowered
    by `rate` nats a step, before `PostTrainMonitor` reads them (TRL logs the lowered values too)."""

    def __init__(self, trainer_ref: list, start: int, rate: float):
        self.trainer_ref, self.start, self.rate = trainer_ref, start, rate

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1
        vals = self.trainer_ref[0]._metrics["train"]["logps/chosen"]
        if step >= self.start and vals:
            vals[-1] -= self.rate * (step - self.start + 1)


def test_the_monitor_says_likelihood_displacement_in_a_real_dpo_run(tmp_path):
    """The rule inside the real trainer: a user's monitor with 8-step windows, the chosen log-probs made to fall from
    step 12 while the margin grows as this run grows it: one warning event with the numbers, the hints filled in."""
    monitor = PostTrainMonitor()
    monitor.preference = PreferenceRules(window=8)
    ref: list = []
    fault = ChosenFalls(ref, start=12, rate=0.6)
    trainer = build_trainer(
        "dpo",
        tmp_path,
        data=preference_rows(4 * 28),
        max_steps=28,
        learning_rate=1e-2,
        beta=1.0,
        callbacks=[fault, monitor],
    )
    ref.append(trainer)
    hf_stable.stabilize(trainer).train()
    said = [e for e in read_events(tmp_path) if e["kind"] in RULES]
    assert [e["kind"] for e in said] == ["likelihood_displacement"], said
    e = said[0]
    assert 16 < e["step"] <= 28 and e["severity"] == "warning" and e["source"] == "PostTrainMonitor"
    assert e["fall"] > 0.1 * abs(e["reference"]) and e["margin"] > e["margin_ref"]
    assert "learning_rate=0.01" in e["message"] and "beta=1.0" in e["message"]
