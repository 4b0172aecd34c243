"""The RL rules on real tiny GRPO runs under `stabilize` (CPU, TRL's defaults): a fault that changes the policy or its
sampling at step 6 makes TRL's own logged signal depart from its early level, and `PostTrainMonitor` names it once
(step 8: the median of the last 5 values past the bar) with the numbers it compared and what to do. The rules'
silence on a clean run is `test_rl_damage.py`'s clean run (no warning-level event) and `test_rl_rules.py`'s clean
series; the importance-ratio tail needs vLLM's sampler (TRL logs it only there): `test_rl_rules.py` covers it.

* ``entropy_collapse``: the output head x1000 (the policy turns near-deterministic: entropy 5.56 -> ~0.1 nats).
* ``entropy_blowup``: a head trained x30 sharp is put back to x1 (entropy ~2.4 -> 5.56 nats, near uniform).
* ``length_runaway`` + ``completions_truncated``: end-of-sequence favoured in sampling, then suppressed (completions
  of 1 token -> all cut at max_completion_length 24), under a reward that pays for brevity (no rise with the length).
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

import hf_stable
from hf_stable.core.events import read_events
from tests.dist_scripts.posttrain_common import build_trainer

pytest.importorskip("trl")

FAULT_STEP = 6


def brevity_reward(completions, **kwargs) -> list[float]:
    return [1.0 / (1 + len(text)) for text in completions]


class AtStep(TrainerCallback):
    def __init__(self, fn):
        self.fn = fn

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == FAULT_STEP:
            self.fn()


def _run(case: str, out):
    length = case == "length"
    trainer = build_trainer(
        "grpo",
        out,
        max_steps=11,
        per_device_train_batch_size=8,
        reward=brevity_reward if length else None,
        **({"max_completion_length": 24} if length else {}),
    )
    head = trainer.model.get_output_embeddings().weight
    gen = trainer.generation_config
    eos = trainer.processing_class.eos_token_id
    if case == "blowup":
        with torch.no_grad():
            head.mul_(30.0)
    if length:
        gen.sequence_bias = {(eos,): 8.0}

    def fault():
        with torch.no_grad():
            if case == "collapse":
                head.mul_(1000.0)
            elif case == "blowup":
                head.div_(30.0)
        if length:
            gen.sequence_bias, gen.suppress_tokens = None, [eos]

    trainer.add_callback(AtStep(fault))
    hf_stable.stabilize(trainer).train()
    history = {h["step"]: h for h in trainer.state.log_history if "entropy" in h}
    return read_events(out), history


RL_KINDS = {"entropy_collapse", "entropy_blowup", "kl_blowup", "length_runaway", "completions_truncated"}


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("collapse", {"entropy_collapse"}),
        ("blowup", {"entropy_blowup"}),
        ("length", {"length_runaway", "completions_truncated"}),
    ],
)
def test_a_fault_in_a_real_grpo_run_is_named_once_with_its_numbers(case, expected, tmp_path):
    events, history = _run(case, tmp_path)
    said = [e for e in events if e["kind"] in RL_KINDS]
    assert {e["kind"] for e in said} == expected, [(e["step"], e["kind"]) for e in said]
    assert len(said) == len(expected)  # once per stretch, not every step the signal stays away
    key = {
        "entropy_collapse": "entropy",
        "entropy_blowup": "entropy",
        "length_runaway": "completions/mean_length",
        "completions_truncated": "completions/clipped_ratio",
    }
    for e in said:
        assert e["step"] == FAULT_STEP + 2 and e["severity"] == "warning" and "What to do" in e["message"]
        early = sorted(history[s][key[e["kind"]]] for s in range(1, 6))[2]  # TRL's logged values, first 5 steps
        assert e["early"] == pytest.approx(early, rel=1e-6)
        low = e["kind"] == "entropy_collapse"
        assert (e["value"] < e["threshold"]) if low else (e["value"] > e["threshold"]), e
        assert e["rollouts"].startswith(f"posttrain_rollouts/step-{FAULT_STEP + 2}-")
        assert (tmp_path / e["rollouts"]).read_text().strip()
    if case == "collapse":
        assert history[FAULT_STEP + 2]["entropy"] < 0.3 * history[FAULT_STEP - 1]["entropy"]
    if case == "length":  # the reward fell with the length: a runaway that earns nothing
        assert history[FAULT_STEP + 2]["reward"] < history[FAULT_STEP - 1]["reward"]
