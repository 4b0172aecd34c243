"""`hf_stable.stabilize(trainer)` on real TRL trainers (DPO, KTO, GRPO; tiny LoRA Llama, CPU, TRL's defaults, so
``max_grad_norm=1.0``): faults inside a step are skipped with the weights left finite, the guards judge the loss TRL
optimizes (``loss/train`` equals TRL's logged ``loss``), a swapped DPO batch is skipped, and a sparse-reward GRPO run
skips nothing a stock run applies.

Faults act before the gradient is read or clipped (`StepFaults`): a NaN forward (the first decoder layer's output),
a NaN gradient in one LoRA tensor, and every LoRA gradient x1e3. Stock TRL on the same faults puts NaN into the
weights (DPO, KTO) or crashes at the next sampling (GRPO).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import hf_stable
from hf_stable.callbacks import build_callbacks
from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards import SkipGuard
from hf_stable.config import RunConfig
from hf_stable.core.events import read_events
from tests.dist_scripts.posttrain_common import (
    StepFaults,
    all_finite,
    build_trainer,
    preference_rows,
    sparse_reward,
    trainable,
)

pytest.importorskip("trl")

# (NaN forward, NaN gradient, x1e3 gradients) steps, and the run's length; GRPO: two groups of 4 per step, so the
# references are warm (3 steps with a learning signal) before the spike
PLANS = {
    "dpo": {"faults": (4, 6, 8), "steps": 10, "kw": {}},
    "kto": {"faults": (4, 6, 8), "steps": 10, "kw": {}},
    "grpo": {"faults": (4, 6, 10), "steps": 11, "kw": {"per_device_train_batch_size": 8}},
}


def _skip_guard(trainer) -> SkipGuard:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, SkipGuard))


@pytest.fixture(scope="module", params=sorted(PLANS))
def faulted(request, tmp_path_factory):
    kind = request.param
    plan = PLANS[kind]
    trainer = build_trainer(kind, tmp_path_factory.mktemp(kind), max_steps=plan["steps"], **plan["kw"])
    nan_forward, nan_grad, spike = plan["faults"]
    faults = StepFaults(trainer.model, nan_forward=[nan_forward], nan_grad=[nan_grad], scale_grad={spike: 1e3})
    trainer.add_callback(faults)
    assert hf_stable.stabilize(trainer) is trainer
    trainer.train()
    return kind, trainer, faults


def test_faults_are_skipped_and_the_weights_stay_finite(faulted):
    kind, trainer, faults = faulted
    assert trainer.args.max_grad_norm == 1.0  # TRL's default: the guards still see the pre-clip gradients
    expected = list(PLANS[kind]["faults"])
    assert _skip_guard(trainer).skipped_steps == expected
    for step in expected:  # a skipped step moved nothing
        before, after = faults.weights[step - 1], faults.weights[step]
        assert all(bool((before[k] == after[k]).all()) for k in before), (kind, step)
    assert all_finite(faults.weights[PLANS[kind]["steps"]])
    reasons = {e["step"]: e["reasons"] for e in read_events(trainer.args.output_dir) if e["kind"] == "step_skipped"}
    assert reasons[expected[0]] == reasons[expected[1]] == ["nonfinite"]
    assert "grad_spike" in reasons[expected[2]]
    # 3 bad steps: the rollback's check re-ran the batches through compute_loss and found the data, not the weights
    kinds = [e["kind"] for e in read_events(trainer.args.output_dir)]
    assert "rollback_declined" in kinds and "rollback" not in kinds
    pairs = {e["step"]: e["records"] for e in read_events(trainer.args.output_dir) if e["kind"] == "step_pairs"}
    if kind == "grpo":  # prompts, not records of a dataset of pairs
        assert not pairs
    else:  # each skipped DPO / KTO step names the 4 records of its batch (indices of the 32-row dataset)
        assert sorted(pairs) == expected
        assert all(len(set(ids)) == 4 and set(ids) <= set(range(32)) for ids in pairs.values()), pairs


def test_the_judged_loss_is_the_loss_trl_logs(faulted):
    kind, trainer, _ = faulted
    faults = set(PLANS[kind]["faults"])
    rows = [h for h in trainer.state.log_history if "loss/train" in h and "loss" in h and h["step"] not in faults]
    assert len(rows) == PLANS[kind]["steps"] - 3
    for h in rows:
        if kind == "grpo":
            assert abs(h["loss/train"] - h["loss"]) <= 1e-5, h
        else:
            assert h["loss/train"] == pytest.approx(h["loss"], rel=1e-3), h
            assert h["loss/train"] < 2.0  # the preference loss, not the sequences' NLL (6-10 on this model)


def test_stabilize_is_idempotent_and_build_callbacks_alone_says_which_loss_it_judges(tmp_path):
    trainer = build_trainer("dpo", tmp_path / "notice", max_steps=1, callbacks=build_callbacks(RunConfig()))
    trainer.train()
    notes = [e for e in read_events(tmp_path / "notice") if e["kind"] == "objective_not_judged"]
    assert len(notes) == 1 and "DPOTrainer" in notes[0]["message"] and "stabilize" in notes[0]["message"]

    trainer = build_trainer("dpo", tmp_path / "twice", max_steps=1)
    hf_stable.stabilize(trainer)
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, StabilityCallback)]
    assert hf_stable.stabilize(trainer) is trainer
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, StabilityCallback)] == ours
    assert type(trainer).__name__ == "StableDPOTrainer"
    trainer.train()
    assert not [e for e in read_events(tmp_path / "twice") if e["kind"] == "objective_not_judged"]


def test_importing_hf_stable_does_not_import_trl():
    code = "import sys, hf_stable; hf_stable.stabilize; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_a_dpo_batch_with_chosen_and_rejected_swapped_is_skipped_and_its_pairs_named(tmp_path):
    """The records come from a JSONL file (``stabilize(trainer, records=path)``): the skipped step names exactly its
    four swapped pairs by file:line, in a `step_pairs` event and in skipped_pairs.jsonl with their text."""
    steps, swapped = 30, 26
    rows = preference_rows(4 * steps)
    for r in rows[4 * (swapped - 1) : 4 * swapped]:  # one batch (sequential order) with the preference reversed
        r["chosen"], r["rejected"] = r["rejected"], r["chosen"]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "run"
    trainer = build_trainer(
        "dpo",
        out,
        data=rows,
        max_steps=steps,
        learning_rate=1e-2,
        beta=1.0,
        train_sampling_strategy="sequential",
    )
    hf_stable.stabilize(trainer, records=path).train()
    loss = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    assert loss[swapped] > 2 * loss[swapped - 1]  # what the swap does to the DPO loss
    events = read_events(out)
    skipped = [e for e in events if e["kind"] == "step_skipped"]
    assert [e["step"] for e in skipped] == [swapped] and "loss_spike" in skipped[0]["reasons"]
    expected = list(range(4 * (swapped - 1), 4 * swapped))
    named = [e for e in events if e["kind"] == "step_pairs"]
    assert len(named) == 1 and named[0]["step"] == swapped and named[0]["records"] == expected
    assert named[0]["where"] == [f"pairs.jsonl:{i + 1}" for i in expected] and "pairs.jsonl:101" in named[0]["message"]
    lines = [json.loads(line) for line in (out / "skipped_pairs.jsonl").read_text().splitlines()]
    assert [(r["step"], r["index"], r["where"], r["reasons"]) for r in lines] == [
        (swapped, i, f"pairs.jsonl:{i + 1}", skipped[0]["reasons"]) for i in expected
    ]
    for r in lines:  # the swapped pair's own text (TRL appended EOS to the completions)
        assert r["prompt"] == rows[r["index"]]["prompt"] and r["chosen"].startswith(rows[r["index"]]["chosen"])


@pytest.mark.slow
def test_sparse_reward_grpo_skips_nothing_and_applies_the_steps_stock_trl_applies(tmp_path):
    """Batch 4, 4 generations (one group a step), 0/1 reward: most steps have exactly zero gradient."""
    weights, norms = {}, {}
    for stabilized in (True, False):
        trainer = build_trainer("grpo", tmp_path / str(stabilized), reward=sparse_reward, max_steps=14)
        if stabilized:
            hf_stable.stabilize(trainer)
        trainer.train()
        weights[stabilized] = trainable(trainer.model)
        norms[stabilized] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert 0 < sum(n > 0 for n in norms[False]) < len(norms[False]) - 5  # sparse: mostly zero-signal steps
    assert not [e for e in read_events(tmp_path / "True") if e["kind"] in ("step_skipped", "grad_vanishing")]
    assert norms[True] == pytest.approx(norms[False], rel=1e-5)
    for name, w in weights[True].items():  # the same updates as stock TRL
        assert float((w - weights[False][name]).abs().max()) <= 1e-6, name
    assert all(math.isfinite(n) for n in norms[True])


def test_stabilize_on_sft_trainer_judges_its_lm_loss(tmp_path):
    """SFTTrainer computes its loss from TRL's own fused log-probs: stabilize keeps that forward (not our chunked
    one) and judges the LM loss TRL logs."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.dist_scripts.posttrain_common import common_args, tiny_policy, tiny_tokenizer

    ds = Dataset.from_list([{"text": "count up 1 2 3 4 5 6"}] * 16)
    args = SFTConfig(**common_args(tmp_path, max_steps=3), max_length=32)
    trainer = SFTTrainer(model=tiny_policy(), args=args, train_dataset=ds, processing_class=tiny_tokenizer())
    hf_stable.stabilize(trainer).train()
    assert type(trainer).__name__ == "StableSFTTrainer" and not trainer.training_loss.chunked
    rows = [h for h in trainer.state.log_history if "loss/train" in h and "loss" in h]
    assert len(rows) == 3 and all(h["loss/train"] == pytest.approx(h["loss"], rel=1e-3) for h in rows)


def test_stabilize_on_rloo_trainer_judges_its_policy_loss(tmp_path):
    """RLOOTrainer is in the online-RL family (GRPO's rules): the guards judge the loss TRL logs, no loss rules."""
    trainer = hf_stable.stabilize(build_trainer("rloo", tmp_path, max_steps=3))
    trainer.train()
    assert type(trainer).__name__ == "StableRLOOTrainer"
    skip = _skip_guard(trainer)
    assert skip.loss_spike_zscore is None and skip.loss_rise_rel is None and skip.skipped_total == 0
    rows = [h for h in trainer.state.log_history if "loss/train" in h and "loss" in h]
    assert len(rows) == 3 and all(abs(h["loss/train"] - h["loss"]) <= 1e-5 for h in rows)
