"""Trajectory forensics (issue 25): every record's answer nats, first-token NLL and margin by sighting, judged at the end of
each epoch - the rule on a synthetic table, then a real tiny Trainer run (`tests/dist_scripts/forensics_run.py`:
the MILD poison, never a culprit of its step), kill -9 + resume with the history, and two ranks."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from hf_stable.forensics.config import ForensicsConfig
from hf_stable.forensics.quarantine import read_quarantine
from hf_stable.forensics.trajectory import LOSS, TrajectoryTable
from tests.dist_scripts.forensics_run import MILD, TRAJECTORY, build, position_of, read_result, run_script

N_RECORDS, PER_STEP = 256, 16
BAR = ForensicsConfig().trajectory_zscore  # the calibrated defaults
EARLY = ForensicsConfig().trajectory_early_zscore
WRONG, HARD = 7, 11  # record ids of the synthetic table


def _rows(epoch: int, rng: random.Random) -> torch.Tensor:
    """One epoch of gathered rows (step, record id, loss, tokens, answer nats, first-token NLL, margin) for a
    population that learns (loss falls ~10 % an epoch; each record keeps its own difficulty, log-normal, as real
    tasks do), a mislabeled record (high loss, an answer of another kind: its first token unexpected, another
    token preferred by far - at both sightings, partly memorised by the second) and a clean hard one (more answer
    nats still, but of the kind its difficulty gives: its first token as expected as anyone's)."""
    hardness = random.Random(99)
    difficulty = [math.exp(0.35 * hardness.gauss(0, 1)) for _ in range(N_RECORDS)]
    order = list(range(N_RECORDS))
    rng.shuffle(order)
    out = []
    for k, rid in enumerate(order):
        step = epoch * (N_RECORDS // PER_STEP) + k // PER_STEP + 1
        d = difficulty[rid] * (1 + 0.05 * rng.gauss(0, 1))
        loss, first, margin = 1.4 * d * 0.9**epoch, 1.2 * d * 0.9**epoch, 3.0 - 1.5 * math.log(d)
        if rid == WRONG:
            loss, first, margin = (4.6, 9.0, -1.9) if epoch == 0 else (3.3, 7.5, -0.3)
        elif rid == HARD:
            loss, first, margin = 5.0, 0.9, 3.0 - 1.5 * math.log(1.5)
        out.append([step, rid, loss, 5.0, 5.0 * loss, first, margin])
    return torch.tensor(out, dtype=torch.float64)


def _table(epochs: int = 2) -> TrajectoryTable:
    rng = random.Random(0)
    table = TrajectoryTable(N_RECORDS, max_sightings=4)
    for e in range(epochs):
        table.add(_rows(e, rng))
    return table


def test_the_rule_names_the_mislabeled_record_not_the_clean_hard_one_and_not_before_two_sightings():
    assert _table(1).judge(min_sightings=2, zscore=BAR) == []  # one sighting: not enough evidence for this bar
    early = _table(1).judge(min_sightings=2, zscore=BAR, early_zscore=EARLY)  # the higher bar for one sighting
    assert [v.record_id for v in early] == [WRONG] and early[0].evidence["threshold"] == EARLY
    table = _table(2)
    verdicts = table.judge(min_sightings=2, zscore=BAR)
    assert [v.record_id for v in verdicts] == [WRONG]
    ev = verdicts[0].evidence
    assert ev["losses"] == [4.6, 3.3] and ev["sightings"] == 2 and len(ev["step_median_losses"]) == 2
    assert ev["score"] > ev["threshold"] == BAR and "rule" in ev and ev["population"]["records"] == N_RECORDS
    # the hard record's loss is further out than the mislabeled one's (a loss-only rule would name it first); the
    # rest of its trajectory is not
    scores = {v.record_id: v for v in table.judge(min_sightings=2, zscore=-1e9)}
    assert scores[HARD].evidence["z_answer_nats@first"] > scores[WRONG].evidence["z_answer_nats@first"]
    assert scores[HARD].score < BAR < scores[WRONG].score
    assert table.judge(min_sightings=2, zscore=BAR, exclude={WRONG}) == []  # quarantined already: not again
    # screening's prompt gain, when it measured one above 1, adds gain_weight x ln(gain) to the score
    table.note_gains([HARD, WRONG], [1.5, 0.8])
    scored = {v.record_id: v.score for v in table.judge(min_sightings=2, zscore=-1e9, gain_weight=8.0)}
    assert scored[HARD] == pytest.approx(scores[HARD].score + 8.0 * math.log(1.5), abs=1e-6) and scored[HARD] > BAR
    assert scored[WRONG] == pytest.approx(scores[WRONG].score, abs=1e-6)


def test_the_table_is_bounded_keeps_the_latest_sightings_and_its_state_is_exact():
    table = _table(2)
    for e in range(2, 6):
        table.add(_rows(e, random.Random(e)))
    assert int(table.seen[WRONG]) == 6 and table.hist.shape == (N_RECORDS, 4, table.hist.shape[2])
    assert table.hist[WRONG, :, LOSS].tolist() == pytest.approx([3.3] * 4)  # sightings 3-6 of 6 kept
    copy = TrajectoryTable()
    copy.load_state_dict(json.loads(json.dumps(table.state_dict())))
    assert torch.equal(copy.seen, table.seen) and torch.equal(copy.tokens, table.tokens)
    assert torch.equal(copy.hist.nan_to_num(-7.0), table.hist.nan_to_num(-7.0))  # bit for bit
    small = TrajectoryTable(4, max_records=8)
    small.add(
        torch.tensor([[1, 3, 2.0, 4, 8.0, 3.0, 1.0], [1, 20, 2.0, 4, 8.0, 3.0, 1.0], [1, -1, -1, -1, -1, -1, -1]])
    )
    assert len(small) == 4 and int(small.seen.sum()) == 1  # an id past max_records and the padding row: ignored


def _poisoned_run(tmp_path, poison_index, mode="auto", **forensics_kw):
    trainer, skip, forensics = build(
        tmp_path, poison_index=poison_index, steps=24, mode=mode, forensics_kw={**TRAJECTORY, **forensics_kw}, **MILD
    )
    trainer.train()
    return skip, forensics


def test_a_mislabeled_record_is_named_by_its_trajectory_at_the_end_of_epoch_1_and_left_out_of_the_next(tmp_path):
    """The default rule: a record seen once whose score clears the higher early bar is named as its first epoch
    ends, not sampled again."""
    idx = position_of(3)
    skip, forensics = _poisoned_run(tmp_path, idx)
    assert skip.skipped_steps == []  # never a culprit of its step: the batch loss looked fine
    entries = read_quarantine(tmp_path)
    assert [(e["where"], e["reason"], e["step"], e["epoch"]) for e in entries] == [
        (f"train.jsonl:{idx + 1}", "trajectory", 8, 0)  # the end of epoch 1 (8 steps an epoch)
    ]
    ev = entries[0]["evidence"]
    assert len(ev["losses"]) == 1 and ev["score"] > ev["threshold"] == ForensicsConfig().trajectory_early_zscore
    assert ev["step_reasons"] == ["trajectory", "epoch 0"] and ev["threshold"] > BAR
    assert int(forensics.trajectory.seen[idx]) == 1  # auto: not sampled in epochs 2 and 3
    assert int(forensics.trajectory.seen.sum()) == 32 * 3 - 2


def test_with_one_bar_only_it_is_named_at_the_end_of_epoch_2_by_two_sightings_and_left_out_of_epoch_3(tmp_path):
    idx = position_of(3)
    skip, forensics = _poisoned_run(tmp_path, idx, trajectory_early_zscore=1e9)  # no early verdict
    assert skip.skipped_steps == []
    entries = read_quarantine(tmp_path)
    assert [(e["where"], e["reason"], e["step"], e["epoch"]) for e in entries] == [
        (f"train.jsonl:{idx + 1}", "trajectory", 16, 1)  # the end of epoch 2 (8 steps an epoch)
    ]
    ev = entries[0]["evidence"]
    assert len(ev["losses"]) == 2 and ev["score"] > ev["threshold"] == BAR
    assert ev["step_reasons"] == ["trajectory", "epoch 1"]
    assert all(math.isfinite(x) for x in ev["losses"] + ev["margins"] + ev["step_median_losses"] + ev["answer_nats"])
    assert int(forensics.trajectory.seen[idx]) == 2  # auto: not sampled in epoch 3
    assert int(forensics.trajectory.seen.sum()) == 32 * 3 - 1


def test_report_mode_names_it_but_keeps_training_on_it_and_a_clean_run_names_nothing(tmp_path):
    idx = position_of(3)
    _, forensics = _poisoned_run(tmp_path / "report", idx, mode="report")
    assert [e["reason"] for e in read_quarantine(tmp_path / "report")] == ["trajectory"]
    assert int(forensics.trajectory.seen[idx]) == 3
    from hf_stable.reporting.report import write_report

    row = next(
        line
        for line in write_report(tmp_path / "report").read_text().split("### Suspect data", 1)[1].splitlines()
        if f"train.jsonl:{idx + 1}" in line
    )
    assert "trajectory" in row and "losses by sighting" in row and "score" in row
    _, clean = _poisoned_run(tmp_path / "clean", -1)
    assert read_quarantine(tmp_path / "clean") == [] and int(clean.trajectory.seen.sum()) == 96


SCRIPT = Path(__file__).parent / "dist_scripts" / "forensics_run.py"


_script, _result = run_script, read_result


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill9_at_the_epoch_end_and_resume_keeps_the_history_and_names_the_same_record(tmp_path):
    """Killed right after checkpoint-8 - the last step of epoch 1, saved before that epoch's end was judged: the
    resumed run loads the history from the checkpoint and judges epoch 1 as its next epoch begins (the default rule
    names the record there). The quarantine, the history and the weights equal the uninterrupted run's."""
    import signal

    idx = position_of(3)
    common = ("--poison-index", idx, "--trajectory", "--steps", 24, "--save-steps", 8)
    _script(tmp_path / "base", *common)
    killed = _script(tmp_path / "run", *common, "--kill-at", 8, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    _script(tmp_path / "run", *common, "--resume")
    (base, w_base), (run, w_run) = _result(tmp_path / "base"), _result(tmp_path / "run")
    assert run["resumed_from"].endswith("checkpoint-8") and run["global_step"] == base["global_step"] == 24
    assert [(e["where"], e["reason"], e["step"]) for e in base["quarantine"]["entries"]] == [
        (f"train.jsonl:{idx + 1}", "trajectory", 8)
    ]
    assert run["quarantine"] == base["quarantine"] and run["trajectory"] == base["trajectory"]
    assert all(torch.equal(w_base[k], w_run[k]) for k in w_base)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_keep_the_same_history_and_name_the_same_record(tmp_path):
    from tests.dist_scripts.harness import torchrun_two_ranks

    idx = position_of(2)
    torchrun_two_ranks(
        SCRIPT,
        str(tmp_path),
        "--poison-index",
        str(idx),
        "--trajectory",
        "--steps",
        "12",
        "--save-steps",
        "100",
        timeout=280,
    )
    (r0, w0), (r1, w1) = _result(tmp_path, 0), _result(tmp_path, 1)
    assert r0["trajectory"] == r1["trajectory"] and r0["quarantine"] == r1["quarantine"]
    table = TrajectoryTable()
    table.load_state_dict(r0["trajectory"])
    # both ranks' samples: 3 epochs of 4 steps x 2 ranks x 4, the named record (at the end of epoch 1) only in the
    # first (accelerate pads the later epochs' 31 records to the ranks' even share with a repeat of one record)
    assert int(table.seen[idx]) == 1 and int(table.seen.sum()) == 32 * 3
    assert [(e["where"], e["reason"]) for e in r0["quarantine"]["entries"]] == [
        (f"train.jsonl:{idx + 1}", "trajectory")
    ]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
