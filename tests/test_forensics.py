"""Spike forensics and quarantine with a real tiny Trainer (issue 16, parts 3-4); the poisoned run is built by
`tests/dist_scripts/forensics_run.py` (a data-driven, reproducible poison: see there)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hf_stable.forensics.quarantine import read_quarantine
from tests.dist_scripts.forensics_run import build, position_of, read_result, run_script


def _run(tmp_path, packing, factor, mode="auto"):
    idx = position_of(6)
    trainer, skip, forensics = build(tmp_path, packing=packing, factor=factor, mode=mode, poison_index=idx)
    trainer.train()
    return trainer, skip, forensics, idx


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("factor", [float("nan"), 60.0])
def test_bad_step_names_the_poisoned_line_and_it_is_never_sampled_again(tmp_path, packing, factor):
    trainer, skip, forensics, idx = _run(tmp_path, packing, factor)
    assert skip.skipped_steps == [6]  # skipped once: epoch 2 (steps 9-16) never sees the record again
    entries = read_quarantine(tmp_path)
    assert [e["where"] for e in entries] == [f"train.jsonl:{idx + 1}"]
    e = entries[0]
    assert e["step"] == 6 and e["reason"] == ("nonfinite_loss" if math.isnan(factor) else "loss_outlier")
    assert e["hash"] == f"h{idx:02d}" and e["preview"] == f"row {idx}"
    if not math.isnan(factor):
        assert e["evidence"]["z"] > 4 and e["evidence"]["loss"] > 2 * e["evidence"]["step_median"]
        assert e["evidence"]["grad_norm"] > 0
    kinds = [ev["kind"] for ev in forensics.events]
    assert kinds.count("samples_quarantined") == 1 and "step_forensics" in kinds
    assert forensics.sampler is not None and forensics.sampler.epoch == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_report_and_card_show_the_suspect_data_table_and_plot(tmp_path):
    from hf_stable.reporting.report import write_report

    _, _, _, idx = _run(tmp_path, True, 60.0)
    text = write_report(tmp_path).read_text()
    section = text.split("### Suspect data", 1)[1]
    row = next(line for line in section.splitlines() if f"train.jsonl:{idx + 1}" in line)
    assert "loss_outlier" in row and "z " in row and f"row {idx}" in row
    assert (tmp_path / "report" / "bad_step_samples.png").stat().st_size > 1000


@pytest.mark.parametrize("poisoned", [True, False])
def test_screening_catches_a_record_too_mild_to_flag_its_step_and_nothing_on_clean_data(tmp_path, poisoned):
    idx = position_of(5)
    trainer, skip, forensics = build(
        tmp_path,
        factor=40.0,
        poison_index=idx if poisoned else -1,
        grad_free=True,
        forensics_kw={"screen": True, "screen_every": 4},
    )
    trainer.train()
    assert skip.skipped_steps == []  # the batch loss never looked bad
    entries = read_quarantine(tmp_path)
    if not poisoned:
        assert entries == [] and len(forensics.state_dict()["reference"]) == 64  # 16 steps x 4 healthy samples
        return
    assert [(e["where"], e["reason"], e["step"]) for e in entries] == [(f"train.jsonl:{idx + 1}", "screen_outlier", 5)]
    assert entries[0]["evidence"]["loss"] > 2 * entries[0]["evidence"]["step_median"]


@pytest.mark.parametrize("explained", [False, True])
def test_a_suspect_whose_prompt_does_not_explain_its_answer_is_named(tmp_path, monkeypatch, explained):
    """A record too mild for the loss rule (under 2x the median) but a robust outlier is a suspect; re-run, its
    prompt gain decides. The gain itself is unit-tested in test_forensics_data; here it is set per sample."""
    from hf_stable.forensics import attribution
    from tests.dist_scripts.forensics_run import MAGIC

    seen = []

    def gain(model, sample, empty, args=None):
        poisoned = bool((sample["input_ids"] == MAGIC).any())
        seen.append(poisoned)
        return 0.5 if explained or not poisoned else 1.3

    monkeypatch.setattr(attribution, "prompt_gain", gain)
    idx = position_of(5)
    trainer, skip, _ = build(
        tmp_path,
        factor=20.0,
        poison_index=idx,
        grad_free=True,
        forensics_kw={"screen": True, "screen_every": 4, "min_excess_nats": 10.0},
    )
    trainer.train()
    assert skip.skipped_steps == [] and True in seen  # the poisoned sample was a suspect and re-run
    entries = read_quarantine(tmp_path)
    if explained:
        assert entries == []
        return
    assert [(e["where"], e["reason"], e["step"]) for e in entries] == [
        (f"train.jsonl:{idx + 1}", "prompt_mismatch", 5)
    ]
    ev = entries[0]["evidence"]
    assert ev["prompt_gain"] == 1.3 and ev["z"] > 3 and ev["loss"] < 2 * ev["step_median"]  # the loss rule alone: no


def test_a_gradient_spike_with_normal_losses_is_attributed_by_per_sample_gradient_norm(tmp_path):
    idx = position_of(5)
    trainer, skip, _ = build(tmp_path, factor=25.0, poison_index=idx)
    trainer.train()
    assert skip.skipped_steps == [5]
    (e,) = read_quarantine(tmp_path)
    assert (e["where"], e["reason"], e["step"]) == (f"train.jsonl:{idx + 1}", "grad_outlier", 5)
    assert e["evidence"]["grad_norm"] > 5 and e["evidence"]["loss"] < 2 * e["evidence"]["step_median"]


def test_with_the_rollback_snapshot_the_culprit_is_bad_at_the_snapshot_weights_too(tmp_path):
    """The recipe's guards (skip, rollback with its snapshot, clipping): the culprit's loss is re-run at the
    snapshot's weights too, and is an outlier there as well - bad data, not damaged weights."""
    from hf_stable.callbacks.guards import build_guards
    from hf_stable.config.guards import GuardsConfig

    cfg = GuardsConfig()
    cfg.skip.warmup_steps = 3
    idx = position_of(6)
    trainer, _, _ = build(tmp_path, factor=60.0, poison_index=idx, guards=build_guards(cfg))
    trainer.train()
    (e,) = read_quarantine(tmp_path)
    assert (e["where"], e["reason"]) == (f"train.jsonl:{idx + 1}", "loss_outlier")
    ev = e["evidence"]
    assert isinstance(ev["loss_at_snapshot"], float) and ev["loss_at_snapshot"] > 2 * ev["step_median"]


def test_report_mode_writes_the_file_but_keeps_training_on_it(tmp_path):
    _, skip, forensics, idx = _run(tmp_path, False, float("nan"), mode="report")
    assert [e["where"] for e in read_quarantine(tmp_path)] == [f"train.jsonl:{idx + 1}"]
    assert len(skip.skipped_steps) == 2  # seen again in epoch 2 (and skipped again), no second entry
    assert forensics.sampler is None


SCRIPT = Path(__file__).parent / "dist_scripts" / "forensics_run.py"


_script, _result = run_script, read_result


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill9_and_resume_with_a_quarantine_equals_the_uninterrupted_run(tmp_path):
    """The record is quarantined at step 3 mid-epoch; the run is killed (SIGKILL) after checkpoint-6 and resumed:
    the regenerated epoch permutation must skip exactly the 6 consumed batches, so the filter applies only from the
    position the record was named at - a whole-permutation filter would shift every later batch."""
    import signal

    idx = position_of(3)
    _script(tmp_path / "base", "--poison-index", idx)
    killed = _script(tmp_path / "run", "--poison-index", idx, "--kill-at", 6, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    _script(tmp_path / "run", "--poison-index", idx, "--resume")
    (base, w_base), (run, w_run) = _result(tmp_path / "base"), _result(tmp_path / "run")
    assert run["resumed_from"].endswith("checkpoint-6") and run["global_step"] == base["global_step"] == 16
    assert base["skipped"] == run["skipped"] == [3]  # never sampled again, in either run
    assert [e["where"] for e in base["quarantine"]["entries"]] == [f"train.jsonl:{idx + 1}"]
    assert run["quarantine"] == base["quarantine"]  # the same entry, the same sampler position, from the checkpoint
    assert w_base.keys() == w_run.keys() and all(torch.equal(w_base[k], w_run[k]) for k in w_base)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_name_the_same_culprit_and_stay_identical(tmp_path):
    from tests.dist_scripts.harness import torchrun_two_ranks

    idx = position_of(6)  # some step of one rank's shard; which rank holds it does not matter
    torchrun_two_ranks(
        SCRIPT,
        str(tmp_path),
        "--poison-index",
        str(idx),
        "--steps",
        "8",
        "--save-steps",
        "100",
        "--packing",
        "--screen",
        timeout=280,
    )
    (r0, w0), (r1, w1) = _result(tmp_path, 0), _result(tmp_path, 1)
    assert r0["quarantine"] == r1["quarantine"] and r0["skipped"] == r1["skipped"] and len(r0["skipped"]) == 1
    entries = r0["quarantine"]["entries"]
    assert [e["where"] for e in entries if e["reason"] != "prompt_mismatch"] == [f"train.jsonl:{idx + 1}"]
    # screening's suspects (thresholds set so low that there are some) are re-run by the rank holding them and
    # named by both ranks alike, each with its measured prompt gain
    screened = [e for e in entries if e["reason"] == "prompt_mismatch"]
    assert screened and all(math.isfinite(e["evidence"]["prompt_gain"]) for e in screened)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("engine", ["zero2", "fsdp2"])
def test_sharded_engines_name_the_same_culprit_on_both_ranks(tmp_path, engine):
    """Under ZeRO-2 and FSDP2 the bad step's record ids and per-sample losses are gathered as under DDP: both ranks
    skip the step, name the poisoned line and quarantine it alike, and end with the same full weights."""
    from tests.dist_scripts.harness import torchrun_two_ranks

    idx = position_of(6)
    torchrun_two_ranks(
        SCRIPT,
        str(tmp_path),
        "--poison-index",
        str(idx),
        "--steps",
        "8",
        "--save-steps",
        "0",
        "--engine",
        engine,
        timeout=380,
    )
    (r0, w0), (r1, w1) = _result(tmp_path, 0), _result(tmp_path, 1)
    assert r0["quarantine"] == r1["quarantine"] and r0["skipped"] == r1["skipped"] and len(r0["skipped"]) == 1
    assert [e["where"] for e in r0["quarantine"]["entries"]] == [f"train.jsonl:{idx + 1}"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0) and all(torch.isfinite(w).all() for w in w0.values())


def test_a_degenerate_answer_is_quarantined_before_the_first_step_and_never_trained_on(tmp_path, monkeypatch):
    import hf_stable.callbacks.spike_forensics as sf
    from hf_stable.data.identity import degenerate_answer

    assert degenerate_answer({"instruction": "q", "output": "#" * 400}) < 0.1
    assert degenerate_answer({"instruction": "q", "output": "An ordinary answer of several words. " * 3}) is None
    assert degenerate_answer({"instruction": "q", "output": "#" * 40}) is None  # too short to tell

    seen = []
    screen = sf.SpikeForensics._screen_forward
    monkeypatch.setattr(
        sf.SpikeForensics,
        "_screen_forward",
        lambda self, kw, out, ids: (seen.extend(ids.tolist()), screen(self, kw, out, ids)),
    )
    idx = position_of(2)  # a record the sampler would yield at step 2
    trainer, _, forensics = build(tmp_path, factor=1.0, poison_index=-1, forensics_kw={"screen": True})
    forensics.records.degenerate = {idx: 0.035}
    trainer.train()
    entries = read_quarantine(tmp_path)
    assert [(e["where"], e["reason"], e["step"], e["position"]) for e in entries] == [
        (f"train.jsonl:{idx + 1}", "degenerate_answer", 0, 0)
    ]
    assert entries[0]["evidence"]["compression"] == 0.035
    assert len(seen) == 16 * 4 - 2 and idx not in seen  # two epochs of 32 records, each without it


def test_a_bad_steps_suspects_get_the_prompt_rule_when_screening(tmp_path, monkeypatch):
    from hf_stable.forensics import attribution

    monkeypatch.setattr(attribution, "prompt_gain", lambda model, sample, empty, args=None: 1.3)
    idx = position_of(6)
    trainer, skip, _ = build(
        tmp_path,
        factor=60.0,
        poison_index=idx,
        forensics_kw={"screen": True, "screen_every": 100, "suspect_zscore": -1e9, "suspect_excess_nats": -1e9},
    )
    trainer.train()
    assert skip.skipped_steps == [6]
    at_6 = [(e["where"], e["reason"]) for e in read_quarantine(tmp_path) if e["step"] == 6]
    assert (f"train.jsonl:{idx + 1}", "loss_outlier") in at_6
    assert len(at_6) == 4 and sum(r == "prompt_mismatch" for _, r in at_6) == 3  # every other sample, at most 4
