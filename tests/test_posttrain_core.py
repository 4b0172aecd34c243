"""No lockout: steps whose gradient is exactly zero (no learning signal) on a plain `Trainer` with hf_stable's default
callbacks.

A sparse-reward GRPO run starts with steps whose every advantage is 0: the gradient is exactly zero. Those steps used
to become the grad-norm reference (an EMA of 0, so every later step was a "spike") and to break the streak of spike
skips that `max_consecutive_skips` releases: learning was locked out. The same happens on any trainer, so this is
tested on the plain `Trainer` with a loss multiplied by 0 at chosen steps.
"""

from __future__ import annotations

from transformers import Trainer

from hf_stable.callbacks import build_callbacks
from hf_stable.callbacks.guards import SkipGuard
from hf_stable.config import RunConfig
from hf_stable.core.events import read_events
from tests.dist_scripts.guards_common import (
    LossFault,
    Recorder,
    all_finite,
    tiny_lora_llama,
    token_data,
    training_args,
    weights_equal,
)


def test_zero_gradient_steps_are_no_reference_and_lock_nothing_out(tmp_path):
    steps = 24
    zero = [*range(1, 13), *range(14, steps + 1, 2)]  # 12 zero-signal steps, then every other step
    model = tiny_lora_llama()
    LossFault(model, zero, factor=0.0)
    rec = Recorder(model)
    args = training_args(tmp_path, max_steps=steps, max_grad_norm=1.0)
    callbacks = build_callbacks(RunConfig(), args)
    Trainer(model=model, args=args, train_dataset=token_data(), callbacks=[*callbacks, rec]).train()

    skip = next(c for c in callbacks if isinstance(c, SkipGuard))
    assert skip.skipped_total == 0, skip.skipped_steps
    events = read_events(tmp_path)
    assert not [e for e in events if e["kind"] in ("step_skipped", "grad_vanishing", "skip_reference_reset")]
    notes = [e for e in events if e["kind"] == "no_learning_signal"]
    assert len(notes) == 1 and notes[0]["severity"] == "info" and notes[0]["step"] == 1
    # every step with a signal moved the weights (none was skipped), and they stay finite
    for step in range(13, steps + 1, 2):
        assert not weights_equal(rec.weights[step - 1], rec.weights[step]), step
    assert all_finite(rec.weights[steps])
    assert skip.stats_state()["norm_ema"] > 0  # the reference never sat at 0


def test_the_rollback_check_compares_gradient_norms_only_for_a_signed_loss():
    """GRPO's loss sits near 0 and is signed: a ratio of summed losses means nothing there (a loss of exactly 0 at
    the current weights used to make the check give up and roll back)."""
    from hf_stable.core.rollback_check import Probe, weights_damaged

    def judge(grad_norm, loss):
        return [0.0, float(grad_norm > 5.0), 0.0, 0.0]

    assert weights_damaged(40.0, 0.0, Probe(1.0, 0.0), Probe(1.0, -0.03), judge) is False  # transient: data
    assert weights_damaged(40.0, -0.1, Probe(40.0, -0.1), Probe(38.0, 0.02), judge) is False  # as bad there
    assert weights_damaged(40.0, 0.02, Probe(40.0, 0.02), Probe(1.0, -0.01), judge) is True  # fine there: weights


def test_a_long_run_of_zero_gradient_steps_is_one_warning(tmp_path):
    """Sparse signal is normal; 50 zero-gradient steps in a row are a run that learns nothing (constant reward)."""
    skip = SkipGuard()
    for step in range(1, 121):
        signal = step in (10, 70)
        skip.decide(step, [0.0] * 5, 0.5 if signal else 0.0, 1.0, no_signal=not signal)
    notes = [(e["step"], e["severity"]) for e in skip.events if e["kind"] == "no_learning_signal"]
    assert notes == [(1, "info"), (60, "warning"), (120, "warning")]
    assert skip.skipped_total == 0
