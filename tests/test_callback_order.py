"""Users' callbacks keep their place, and reporting integrations still see hf_stable's metrics.

For the stock `Trainer` (+ `order_for_reporting`), `StableTrainer` and TRL's `SFTTrainer` (+ `order_for_reporting`):

* a user callback listed before `build_callbacks(...)` runs before the skip guard in `on_pre_optimizer_step`: it
  writes NaN into a gradient at step 2, and the guard's verdict of step 2 is a non-finite skip;
* a reporting integration added by `report_to` - TensorBoard's own callback class, subclassed to record instead of
  writing (tensorboard is not installed here) and registered under "tensorboard" - gets the `grad/...` keys.
"""

from __future__ import annotations

import math

import pytest
from transformers import Trainer, TrainerCallback
from transformers.integrations import TensorBoardCallback, integration_utils

from hf_stable.callbacks import StabilityCallback, build_callbacks, order_for_reporting
from hf_stable.callbacks.guards import SkipGuard
from hf_stable.config import RunConfig
from hf_stable.trainer import StableTrainer
from tests.dist_scripts.guards_common import all_finite, tiny_lora_llama, token_data, trainable, training_args

NAN_STEP = 2


class RecordingTensorBoard(TensorBoardCallback):
    """TensorBoard's integration, recording each log line instead of writing event files."""

    def __init__(self):  # the parent needs tensorboard installed; nothing of it is used here
        self.logged: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        pass

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs or {}))

    def on_train_end(self, args, state, control, **kwargs):
        pass


class NaNGradient(TrainerCallback):
    """A user's gradient hook: NaN into one gradient at `NAN_STEP`; notes whether the skip guard had already judged
    the step when it ran."""

    def __init__(self, skip: SkipGuard):
        self.skip = skip
        self.after_the_guard: list[bool] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1
        verdict = self.skip.last_verdict
        self.after_the_guard.append(verdict is not None and verdict.step == step)
        if step == NAN_STEP:
            params = [p for p in model.parameters() if p.grad is not None]
            for p in params:  # new gradient tensors: the shared statistics read them afresh
                p.grad = p.grad.clone()
            params[0].grad.view(-1)[0] = float("nan")


@pytest.fixture
def tensorboard_stand_in(monkeypatch):
    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "tensorboard", RecordingTensorBoard)


def _build(kind: str, tmp_path, tokenizer, order: bool = True):
    model = tiny_lora_llama()
    args_kw = {"max_steps": 4, "per_device_train_batch_size": 2, "logging_steps": 1, "report_to": ["tensorboard"]}
    if kind == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            learning_rate=1e-3,
            gradient_checkpointing=False,
            **args_kw,
        )
    else:
        args = training_args(tmp_path, **args_kw)
    ours = build_callbacks(RunConfig(), args)
    skip = next(cb for cb in ours if isinstance(cb, SkipGuard))
    user = NaNGradient(skip)
    rows = token_data(16)
    if kind == "sft":
        data = Dataset.from_list([{"input_ids": r["input_ids"].tolist()} for r in rows])
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[user, *ours]
        )
    else:
        cls = StableTrainer if kind == "stable" else Trainer
        trainer = cls(model=model, args=args, train_dataset=rows, callbacks=[user, *ours])
    if order and kind != "stable":  # StableTrainer orders its callbacks itself
        order_for_reporting(trainer)
    return trainer, model, skip, user


@pytest.mark.parametrize("kind", ["trainer", "stable", "sft"])
def test_user_callback_runs_first_and_reporters_get_our_metrics(kind, tmp_path, tokenizer, tensorboard_stand_in):
    trainer, model, skip, user = _build(kind, tmp_path, tokenizer)
    handler = trainer.callback_handler.callbacks
    names = [type(cb).__name__ for cb in handler]
    last_ours = max(i for i, cb in enumerate(handler) if isinstance(cb, StabilityCallback))
    assert names[0] == "DefaultFlowCallback" and names[1] == "NaNGradient", names
    # disable_tqdm: build_callbacks' one-line CompactPrinter replaces the Trainer's PrinterCallback, still last
    assert last_ours < names.index("RecordingTensorBoard") < names.index("CompactPrinter") == len(names) - 1, names
    assert "PrinterCallback" not in names and "ProgressCallback" not in names, names

    trainer.train()
    assert user.after_the_guard == [False] * 4  # the user's hook ran before the guard judged, every step
    assert (
        skip.skipped_steps == [NAN_STEP]
        and "nonfinite" in next(e for e in skip.events if e["kind"] == "step_skipped")["reasons"]
    )
    assert all_finite(trainable(model))  # the NaN the user's hook wrote was never applied
    reporter = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, RecordingTensorBoard))
    train_lines = [logs for logs in reporter.logged if "loss" in logs]
    assert len(train_lines) == 4
    assert all("grad/norm_global" in logs and "guard/skipped_total" in logs for logs in train_lines)
    assert math.isnan(train_lines[NAN_STEP - 1]["grad/norm_global"])


def test_stock_trainer_without_the_call_reports_without_our_metrics(tmp_path, tokenizer, tensorboard_stand_in):
    """What `order_for_reporting` is for: the Trainer calls the integrations before the user's callbacks."""
    trainer, _, _, _ = _build("trainer", tmp_path, tokenizer, order=False)
    trainer.train()
    reporter = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, RecordingTensorBoard))
    assert reporter.logged and not any("grad/norm_global" in logs for logs in reporter.logged)
    assert "grad/norm_global" in trainer.state.log_history[0]  # trainer_state.json has them either way


def test_order_for_reporting_keeps_everything_else_in_place():
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, PrinterCallback

    user_a, user_b = TrainerCallback(), TrainerCallback()
    ours = build_callbacks(RunConfig())
    handler = CallbackHandler(
        [DefaultFlowCallback, RecordingTensorBoard, user_a, *ours, user_b, PrinterCallback], None, None, None, None
    )
    order_for_reporting(handler)
    order_for_reporting(handler)  # idempotent
    cbs = handler.callbacks
    assert [type(cb) for cb in cbs[:2]] == [DefaultFlowCallback, TrainerCallback] and cbs[1] is user_a
    assert cbs[2 : 2 + len(ours)] == ours and cbs[2 + len(ours)] is user_b
    assert [type(cb) for cb in cbs[-2:]] == [RecordingTensorBoard, PrinterCallback]


class LookupSpy(TrainerCallback):
    """Defines no hook of its own; records every hook the handler looks up on it, and `calls` what it ran."""

    def __init__(self, name: str, calls: list):
        self.lookups: list[str] = []
        self.name, self.calls = name, calls

    def __getattribute__(self, attr):
        if attr.startswith("on_"):
            object.__getattribute__(self, "lookups").append(attr)
        return object.__getattribute__(self, attr)


class StepBeginRecorder(TrainerCallback):
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def on_step_begin(self, args, state, control, **kwargs):
        self.calls.append((self.name, state.global_step))


class BaseHooksSpy(StabilityCallback):
    """A StabilityCallback with only the base class's hooks; records the hooks the handler looks up on it."""

    def __init__(self):
        super().__init__()
        self.lookups: list[str] = []

    def __getattribute__(self, attr):
        if attr.startswith("on_step"):
            object.__getattribute__(self, "lookups").append(attr)
        return object.__getattribute__(self, attr)


@pytest.mark.parametrize("cls", [Trainer, StableTrainer])
def test_stable_trainer_calls_only_the_hooks_that_act_in_the_listed_order(cls, tmp_path):
    """`StableTrainer` skips TrainerCallback's no-op hooks (`skip_noop_hooks`), the base StabilityCallback's
    `on_step_end` (the state is written at checkpoints) and all but the first base `on_step_begin` (one start of the
    step's shared statistics does for all); every hook that acts - a class's own or one patched onto an instance
    before training - runs at every event, in the listed order, as in the stock Trainer."""
    calls: list = []
    first, idle, patched, last = (
        StepBeginRecorder("first", calls),
        LookupSpy("idle", calls),
        LookupSpy("patched", calls),
        StepBeginRecorder("last", calls),
    )
    base_a, base_b = BaseHooksSpy(), BaseHooksSpy()
    trainer = cls(
        model=tiny_lora_llama(),
        args=training_args(tmp_path, max_steps=3, per_device_train_batch_size=2),
        train_dataset=token_data(8),
        callbacks=[first, base_a, idle, patched, base_b, last],
    )
    patched.on_step_begin = lambda args, state, control, **kw: calls.append(("patched", state.global_step))
    trainer.train()
    assert calls == [(name, step) for step in range(3) for name in ("first", "patched", "last")]
    if cls is StableTrainer:
        assert "on_pre_optimizer_step" not in idle.lookups and "on_step_begin" not in idle.lookups
        assert "on_pre_optimizer_step" not in patched.lookups
        assert base_a.lookups.count("on_step_begin") == 3 and "on_step_begin" not in base_b.lookups
        assert "on_step_end" not in base_a.lookups + base_b.lookups
    else:  # the stock handler looks up (and calls) every hook of every callback
        assert idle.lookups.count("on_pre_optimizer_step") == 3
        assert base_a.lookups.count("on_step_end") == base_b.lookups.count("on_step_begin") == 3


class OwnStabilityCallback(StabilityCallback):
    """A user's own subclass of hf_stable's base class, editing a gradient in place (same tensor, new version)."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == NAN_STEP:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")


@pytest.mark.parametrize("editor", ["subclass", "patched"])
def test_an_edit_between_our_callbacks_is_judged_by_the_skip_guard(editor, tmp_path):
    """The gradient statistics are read first by the monitors listed before the skip guard; a callback between them
    and the guard that writes NaN in place - a user's own StabilityCallback subclass, or a hook patched onto one of
    ours - ends the span of our callbacks, so the guard checks the gradients again and skips the step."""
    args = training_args(tmp_path, max_steps=3, per_device_train_batch_size=2)
    ours = build_callbacks(RunConfig(), args)
    skip = next(cb for cb in ours if isinstance(cb, SkipGuard))
    readers = [i for i, cb in enumerate(ours) if type(cb).__name__ == "GradientMonitor"]
    assert readers and readers[0] < ours.index(skip)  # the statistics are gathered before the guard reads them
    if editor == "subclass":
        ours.insert(ours.index(skip), OwnStabilityCallback())
    else:
        host = next(
            cb for cb in ours[readers[0] + 1 : ours.index(skip)] if type(cb).__module__.startswith("hf_stable")
        )
        host.on_pre_optimizer_step = OwnStabilityCallback().on_pre_optimizer_step
    model = tiny_lora_llama()
    StableTrainer(model=model, args=args, train_dataset=token_data(8), callbacks=ours).train()
    assert skip.skipped_steps == [NAN_STEP] and all_finite(trainable(model))
