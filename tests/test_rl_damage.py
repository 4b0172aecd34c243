"""A GRPO step with damaged inputs (`hf_stable.integrations.rl_damage`) is skipped on every rank, on a real tiny
GRPOTrainer under `stabilize` (CPU, TRL's defaults): NaN old log-probs, or every importance ratio x22026 (the old
log-probs lowered by 10), at one step -> that step is skipped with reason ``damaged`` and the numbers, the weights are
unchanged on that step and finite after, and the batch it trained on is written to
``posttrain_rollouts/step-<N>-step_skipped.jsonl``; a clean run skips nothing and says nothing at warning level (no
``attn_monitor_inactive``: stabilize's default config follows the user's ``sdpa`` model).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import hf_stable
from hf_stable.core.events import read_events
from tests.dist_scripts.posttrain_common import RolloutFaults, StepFaults, all_finite, build_trainer

pytest.importorskip("trl")

FAULT_STEP = 4
RUNS = {"clean": {}, "nan_old": {"nan_old": [FAULT_STEP]}, "ratio": {"ratio": [FAULT_STEP]}}


@pytest.fixture(scope="module", params=sorted(RUNS))
def grpo_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    trainer = build_trainer("grpo", out, max_steps=6, per_device_train_batch_size=8)
    recorder = StepFaults(trainer.model)  # no faults: records the weights after every step
    trainer.add_callback(recorder)
    RolloutFaults(trainer, **RUNS[request.param])
    hf_stable.stabilize(trainer).train()
    return request.param, trainer, recorder, read_events(out)


def _same(a: dict, b: dict) -> bool:
    return all(bool((a[k] == b[k]).all()) for k in a)


def test_a_damaged_step_is_skipped_and_the_weights_stay_finite(grpo_run):
    kind, trainer, recorder, events = grpo_run
    skipped = [e for e in events if e["kind"] == "step_skipped"]
    w = recorder.weights
    assert all_finite(w[max(w)])
    if kind == "clean":
        assert skipped == []
        assert not [e for e in events if e.get("severity") in ("warning", "error", "critical")]
        return
    assert [e["step"] for e in skipped] == [FAULT_STEP]
    assert "damaged" in skipped[0]["reasons"]
    assert _same(w[FAULT_STEP], w[FAULT_STEP - 1])  # the skipped step left the weights alone
    assert not _same(w[FAULT_STEP + 1], w[FAULT_STEP])  # the run goes on learning
    noise = skipped[0]["noise"]
    if kind == "nan_old":
        assert noise["nonfinite_logps"] > 0 and "non-finite old/sampling log-probs" in skipped[0]["message"]
        assert skipped[0]["reasons"] == ["nonfinite", "damaged"]  # the NaN reaches the loss too
    else:
        assert noise["ratio_tail"] > 0 and noise["nonfinite_logps"] == 0
        assert noise["ratio_max"] == pytest.approx(math.exp(10), rel=1e-3)
        assert "importance ratios above 1000" in skipped[0]["message"]
    # the generation batch the step trained on: prompts, completions, rewards, advantages (one row per completion)
    rel = skipped[0]["rollouts"]
    assert rel == f"posttrain_rollouts/step-{FAULT_STEP}-step_skipped.jsonl" and rel in skipped[0]["message"]
    rows = [json.loads(line) for line in (Path(trainer.args.output_dir) / rel).read_text().splitlines()]
    assert len(rows) == 8 and [r["group"] for r in rows] == [0] * 4 + [1] * 4
    assert all(r["completion"] and r["prompt"] and set(r) >= {"rewards", "advantage"} for r in rows)
    assert sum(r["advantage"] for r in rows) == pytest.approx(0.0, abs=1e-4)  # advantages centred per group


def test_stock_grpo_takes_the_nan_old_logprobs_into_its_weights(tmp_path):
    """What the skip prevents: the same fault without stabilize leaves NaN in the weights (or crashes sampling)."""
    trainer = build_trainer("grpo", tmp_path, max_steps=FAULT_STEP, per_device_train_batch_size=8)
    recorder = StepFaults(trainer.model)
    trainer.add_callback(recorder)
    RolloutFaults(trainer, nan_old=[FAULT_STEP])
    trainer.train()
    assert not all_finite(recorder.weights[FAULT_STEP])


def test_rloo_sequence_ratio_exploding_is_skipped(tmp_path):
    """RLOO's importance ratio is per sequence (``old_logps``): x22026 at one step -> that step skipped, `damaged`."""
    trainer = build_trainer("rloo", tmp_path, max_steps=FAULT_STEP + 1, per_device_train_batch_size=8)
    RolloutFaults(trainer, ratio=[FAULT_STEP])
    hf_stable.stabilize(trainer).train()
    skipped = [e for e in read_events(tmp_path) if e["kind"] == "step_skipped"]
    assert [e["step"] for e in skipped] == [FAULT_STEP] and "damaged" in skipped[0]["reasons"]
    assert skipped[0]["noise"]["ratio_tail"] == 8  # one per sequence
    assert skipped[0]["noise"]["ratio_max"] == pytest.approx(math.exp(10), rel=1e-3)


def test_a_kl_push_on_a_real_grpo_run_is_named_with_its_rollouts(tmp_path):
    """beta 0.04, the head x30 (the stock tiny head keeps any KL under 0.03), every LoRA B + N(0, 1) before step 6:
    `kl_blowup` once the median of the last 5 KLs passes 1.0, with the numbers and the batch's rollouts."""
    import torch
    from transformers import TrainerCallback

    trainer = build_trainer("grpo", tmp_path, max_steps=9, per_device_train_batch_size=8, beta=0.04)
    with torch.no_grad():
        trainer.model.get_output_embeddings().weight.mul_(30.0)

    class Push(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == 6:
                g = torch.Generator().manual_seed(0)  # one stream over the tensors (KL 12-16 after the push)
                with torch.no_grad():
                    for n, p in trainer.model.named_parameters():
                        if "lora_B" in n:
                            p.add_(torch.randn(p.shape, generator=g))

    trainer.add_callback(Push())
    hf_stable.stabilize(trainer).train()
    events = read_events(tmp_path)
    kl = [e for e in events if e["kind"] == "kl_blowup"]
    assert [e["step"] for e in kl] == [8] and kl[0]["value"] > 1.0 and kl[0]["early"] < 0.1
    assert kl[0]["threshold"] == 1.0 and "What to do" in kl[0]["message"]
    rows = (tmp_path / kl[0]["rollouts"]).read_text().splitlines()
    assert kl[0]["rollouts"] == "posttrain_rollouts/step-8-kl_blowup.jsonl" and len(rows) == 8
    assert not [e for e in events if e["kind"] == "step_skipped"]  # named, not acted on: the step is not damaged
