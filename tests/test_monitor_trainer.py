"""The monitors inside real tiny Trainer runs: NaN locator, per-step loss, resume, post-clip and off paths."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_stable.callbacks.monitors import build_monitors
from hf_stable.callbacks.monitors.gradient_monitor import GradientMonitor
from hf_stable.config import MonitorsConfig
from hf_stable.core.events import read_events
from tests.helpers import make_tiny_model


def _data(vocab, n=48, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _args(out, **kw):
    base = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "max_grad_norm": 0.0,
        "learning_rate": 1e-3,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    base.update(kw)
    return TrainingArguments(**base)


class _Poison(TrainerCallback):
    """Makes one parameter's gradient NaN at one step through a tensor hook (the fault the locator must name)."""

    def __init__(self, param, at_step):
        self.param, self.at_step, self.handle = param, at_step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at_step:
            self.handle = self.param.register_hook(lambda g: torch.full_like(g, float("nan")))

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_nan_locator_names_the_poisoned_parameter(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    target_name = "model.layers.1.mlp.down_proj.weight"
    target = dict(model.named_parameters())[target_name]
    cfg = MonitorsConfig()
    cfg.nonfinite.detect_anomaly = True
    monitors = build_monitors(cfg)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, max_steps=5),
        train_dataset=_data(model.config.vocab_size),
        callbacks=[*monitors, _Poison(target, at_step=3)],
    )
    trainer.train()
    events = read_events(tmp_path)
    located = [e for e in events if e["kind"] == "nonfinite_grad"]
    assert located, events
    first = located[0]
    assert first["step"] == 3 and first["params"] == [target_name] and first["group"] == "layer_1"
    assert target_name in first["message"] and "re-run" in first["message"]
    assert "no backward op produced it" in first["message"]  # a hook, not an op, made the NaN
    history = {h["step"]: h for h in trainer.state.log_history if "grad/nonfinite_total" in h}
    assert history[2]["grad/nonfinite_total"] == 0 and history[3]["grad/nonfinite_total"] > 0
    assert math.isnan(history[3]["grad/norm_global"])  # logged as NaN, never as 0


def test_step_loss_matches_trainer_loss_with_accumulation(tokenizer, tmp_path):
    model = make_tiny_model("qwen2", tokenizer)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, max_steps=4, gradient_accumulation_steps=2, per_device_train_batch_size=2),
        train_dataset=_data(model.config.vocab_size),
        callbacks=build_monitors(MonitorsConfig()),
    )
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss" in h and "loss/train" in h]
    assert len(rows) == 4
    for row in rows:  # logging_steps=1: the Trainer's logged loss is that step's loss
        assert row["loss/train"] == pytest.approx(row["loss"], rel=1e-5)
        assert row["grad/norm_global"] == pytest.approx(row["grad_norm"], rel=1e-4)
        assert row["mem/rss_gib"] > 0
    assert all(row["perf/tokens_per_s"] > 0 for row in rows[1:])  # step 1 is the untimed warm-up
    assert {k for k in rows[-1] if k.startswith("grad/norm/")} == {
        "grad/norm/embeddings",
        "grad/norm/layer_0",
        "grad/norm/layer_1",
        "grad/norm/norm",
    }  # lm_head tied
    assert not [e for e in read_events(tmp_path) if e["severity"] != "info"]  # a healthy run: no alerts


def _run_lora(tokenizer, out, max_steps, resume=None, monitors=None):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        make_tiny_model("llama", tokenizer, seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    cfg = MonitorsConfig()
    cfg.update.every_n_steps = 2
    cfg.memory.every_n_steps = 1
    cfg.memory.warmup_steps = 0
    cfg.loss.spike_min_history = 3
    monitors = monitors or build_monitors(cfg)
    args = _args(out, max_steps=max_steps, save_strategy="steps", save_steps=3, learning_rate=5e-3)
    trainer = Trainer(model=model, args=args, train_dataset=_data(model.config.vocab_size, n=64), callbacks=monitors)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, monitors


def test_resume_restores_every_monitor_state(tokenizer, tmp_path):
    _, first = _run_lora(tokenizer, tmp_path, max_steps=6)
    saved = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())["stateful_callbacks"]
    saved = saved["hf_stable"]
    assert set(saved) == {type(cb).__name__ for cb in first}
    assert len(saved["LossMonitor"]["history"]) == 3 and saved["MemoryMonitor"]["trend"]

    restored: dict[str, dict] = {}

    class Spy(TrainerCallback):  # runs after the monitors' on_train_begin: records what they restored
        def on_train_begin(self, args, state, control, **kwargs):
            restored.update({type(cb).__name__: cb.state_dict() for cb in fresh})

    fresh = build_monitors(MonitorsConfig())
    _, fresh = _run_lora(
        tokenizer, tmp_path, max_steps=6, resume=str(tmp_path / "checkpoint-3"), monitors=[*fresh, Spy()]
    )
    fresh = fresh[:-1]
    for name, state in saved.items():
        assert json.loads(json.dumps(restored[name])) == state, name
    # deterministic monitors continue exactly where the uninterrupted run went
    by_name = {type(cb).__name__: cb for cb in first}
    for cb in fresh:
        name = type(cb).__name__
        if name in ("LossMonitor", "GradientMonitor", "UpdateMonitor", "NonFiniteLocator"):
            assert _close(cb.state_dict(), by_name[name].state_dict()), name
        if name == "ThroughputMonitor":  # times differ, counts do not: the warm-up step is the run's first only
            resumed, straight = cb.state_dict()["totals"], by_name[name].state_dict()["totals"]
            assert resumed["steps"] == straight["steps"] == 5 and resumed["tokens"] == straight["tokens"]


def _close(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-7)
    return a == b


def test_post_clip_notice_and_deepspeed_off_never_logs_zeros(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    state, control = TrainerState(), TrainerControl()
    # a user who keeps the Trainer's clip: numbers are post-clip, said once
    mon = GradientMonitor()
    mon.on_train_begin(SimpleNamespace(output_dir=str(tmp_path), max_grad_norm=1.0, deepspeed=None), state, control)
    # DeepSpeed: p.grad is None; the monitor says it is off and records nothing
    ds = GradientMonitor()
    ds.on_train_begin(
        SimpleNamespace(output_dir=str(tmp_path), max_grad_norm=0.0, deepspeed={"zero": 2}), state, control
    )
    ds.on_pre_optimizer_step(None, state, control, model=model)
    # no gradients at all (no DeepSpeed flag): discovered at the hook, said once
    bare = GradientMonitor()
    bare.on_train_begin(SimpleNamespace(output_dir=str(tmp_path), max_grad_norm=0.0, deepspeed=None), state, control)
    for _ in range(3):
        bare.on_pre_optimizer_step(None, state, control, model=model)
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds == ["monitor_notice", "monitor_off", "monitor_off"]
    assert ds._pending == {} and bare._pending == {}


def test_anomaly_rerun_names_the_backward_op(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer)
    mlp = model.model.layers[0].mlp
    # the forward value is unchanged (sqrt(0) = 0) but the backward of sqrt at 0 is inf, and inf - inf is NaN
    mlp.register_forward_hook(lambda module, args, out: out + torch.sqrt(out - out))
    cfg = MonitorsConfig()
    cfg.nonfinite.detect_anomaly = True
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, max_steps=1),
        train_dataset=_data(model.config.vocab_size),
        callbacks=build_monitors(cfg),
    )
    trainer.train()
    (event,) = [e for e in read_events(tmp_path) if e["kind"] == "nonfinite_grad"]
    assert event["op"] and event["op"].endswith("Backward0") and f"backward op {event['op']}" in event["message"]
    # NaN flows backwards from layer 0's MLP: the embedding and layer 0 are hit, the layers above are not
    assert "model.embed_tokens.weight" in event["params"]
    assert not any(p.startswith("model.layers.1.") for p in event["params"])


def test_a_transient_nan_loss_is_reported_as_not_reproduced(tmp_path):
    from tests.dist_scripts.guards_common import LossFault, tiny_lora_llama, token_data, training_args

    model = tiny_lora_llama()
    LossFault(model, [3])  # the 3rd training forward only: the locator's re-run of step 3 is clean
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=4),
        train_dataset=token_data(),
        callbacks=build_monitors(MonitorsConfig()),
    )
    trainer.train()
    events = {e["kind"]: e for e in read_events(tmp_path) if e["step"] == 3}
    assert events["nonfinite_loss"]["severity"] == "error"
    message = events["nonfinite_grad"]["message"]
    assert "the loss is non-finite" in message and "did not reproduce" in message
