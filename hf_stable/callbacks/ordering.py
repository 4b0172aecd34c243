"""`order_for_reporting(trainer)`: reporting integrations run after the callbacks whose metrics they report.

hf_stable callbacks add their metrics to the Trainer's `logs` in `on_log`. The Trainer builds its callback list as
DefaultFlowCallback, the integrations `report_to` asks for (TensorBoard, W&B, MLflow ...), the user's `callbacks=`,
then the progress bar / printer - so the integrations would write each log line before our metrics are in it.
Rather than moving our callbacks forward (which would also move them ahead of the user's own callbacks: a user's
gradient hook listed first must still run before the skip guard), this moves the *reporters* back:

    DefaultFlowCallback, the user's callbacks in the user's order (hf_stable's among them), reporters, printers

When a `CompactPrinter` (from `build_callbacks(cfg, args)` with `disable_tqdm`) is present it replaces the
Trainer's own `PrinterCallback` / `ProgressCallback`, which are then dropped.

An explicit call, not something the callbacks discover: `StableTrainer` makes it in `__init__`; with the stock
`Trainer` or TRL's `SFTTrainer` call it once after building the trainer (again after adding callbacks whose
metrics the reporters should see).

Example:
    >>> trainer = Trainer(model=model, args=args, callbacks=[my_callback, *build_callbacks(cfg, args)])
    >>> order_for_reporting(trainer)
"""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.compact_printer import CompactPrinter
from hf_stable.core.grad_span import close_span, open_span


def _reporter_classes() -> tuple[type, ...]:
    """transformers' reporting integrations: the classes `report_to` names map to (their subclasses included)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return tuple(cls for cls in INTEGRATION_TO_CALLBACK.values() if isinstance(cls, type))


def _printer_classes() -> tuple[type, ...]:
    classes: tuple[type, ...] = (PrinterCallback, ProgressCallback, CompactPrinter)
    try:  # needs IPython
        from transformers.utils.notebook import NotebookProgressCallback
    except ImportError:
        return classes
    return (*classes, NotebookProgressCallback)


def reporting_order(callbacks: list[TrainerCallback]) -> list[TrainerCallback]:
    """`callbacks` with the reporting integrations moved after every other callback but the printers; the rest
    keep their relative order. A `CompactPrinter` replaces the Trainer's own printers."""
    reporters, printers = _reporter_classes(), _printer_classes()
    if any(isinstance(cb, CompactPrinter) for cb in callbacks):  # it replaces the Trainer's printer / progress bar
        callbacks = [cb for cb in callbacks if isinstance(cb, CompactPrinter) or not isinstance(cb, printers)]
    is_reporter = [isinstance(cb, reporters) for cb in callbacks]
    is_printer = [not r and isinstance(cb, printers) for cb, r in zip(callbacks, is_reporter, strict=False)]
    rest = [cb for cb, r, p in zip(callbacks, is_reporter, is_printer, strict=False) if not (r or p)]
    return (
        rest
        + [cb for cb, r in zip(callbacks, is_reporter, strict=False) if r]
        + [cb for cb, p in zip(callbacks, is_printer, strict=False) if p]
    )


def order_for_reporting(trainer) -> None:
    """Reorder `trainer.callback_handler` (a `Trainer` or a `CallbackHandler`) so that the reporting integrations
    see every callback's metrics (see the module docstring). Idempotent.

    Example:
        >>> from hf_stable.callbacks import build_callbacks, order_for_reporting
        >>> trainer = SFTTrainer(model=model, args=args, train_dataset=ds, callbacks=build_callbacks(cfg, args))
        >>> order_for_reporting(trainer)
    """
    handler = getattr(trainer, "callback_handler", trainer)
    ordered = reporting_order(list(handler.callbacks))
    if len(ordered) != len(handler.callbacks) or any(
        a is not b for a, b in zip(ordered, handler.callbacks, strict=False)
    ):
        handler.callbacks = ordered  # a new list: a loop already iterating the old one is not disturbed


# --- dispatch ------------------------------------------------------------------------------------------------------
_NO_OPS = {name: fn for name, fn in vars(TrainerCallback).items() if name.startswith("on_")}


def _ours(callback: TrainerCallback) -> bool:
    """A callback of this package (a user's subclass of one is the user's: it may edit the gradients)."""
    return type(callback).__module__.startswith("hf_stable.")


def _acts(callback: TrainerCallback, event: str) -> bool:
    """Whether `callback`'s hook for `event` does anything: a class or an instance overrides TrainerCallback's no-op."""
    return _patched(callback, event) or getattr(type(callback), event, None) is not _NO_OPS.get(event)


def _patched(callback: TrainerCallback, event: str) -> bool:
    """The hook was set on the instance (a wrapper, a test's patch): whatever it runs is not ours."""
    return event in getattr(callback, "__dict__", {})


def _live(callbacks: tuple, event: str) -> list[tuple[TrainerCallback, bool]]:
    """(callback, whether it is ours) for each callback whose hook for `event` acts, in order. Two hooks of the base
    class act less than once per callback: `StabilityCallback.on_step_end` writes nothing when the trainer writes the
    callbacks' state at its checkpoints (`writes_state_at_checkpoints`, StableTrainer), and
    `StabilityCallback.on_step_begin` starts the step of the model's shared statistics, which the first of them does
    for all (every callback gets the same model)."""
    out, began = [], False
    for cb in callbacks:
        if not _acts(cb, event):
            continue
        patched = _patched(cb, event)
        hook = getattr(type(cb), event, None)
        if not patched and hook is StabilityCallback.on_step_end and cb.writes_state_at_checkpoints:
            continue
        if not patched and hook is StabilityCallback.on_step_begin:
            if began:
                continue
            began = True
        out.append((cb, _ours(cb) and not patched))
    return out


def skip_noop_hooks(handler) -> None:
    """Make `handler.call_event` call only the callbacks whose hook for the event is not TrainerCallback's no-op.

    The stock handler calls every callback at every event with eight keyword arguments, ~1 us each: with the recipe's
    ~20 callbacks, half of them without an `on_pre_optimizer_step` or `on_optimizer_step`, that is ~0.04 ms a step of
    calls that do nothing. The same callbacks run, in the same order, with the same arguments. Which callbacks act is
    listed once per event and list of callbacks, and listed afresh at every `on_train_begin` (a hook patched onto an
    instance before training counts). Two base-class hooks that would repeat one another are called once (`_live`).

    A run of consecutive hf_stable callbacks is a span (`core.grad_stats.open_span`): the step's gradients, once found
    unchanged in it, are not checked again by the next of them (each check reads every gradient's identity and
    version, ~15-35 us). Any other callback, a hook patched onto one of ours, or a skip that drops the gradients ends
    the span, so a gradient edited there is still seen.

    Example:
        >>> skip_noop_hooks(trainer.callback_handler)   # StableTrainer does it in __init__
    """
    if getattr(handler, "_hf_stable_live", None) is not None:
        return
    live: dict[str, tuple[tuple, list]] = {}
    handler._hf_stable_live = live

    def call_event(event, args, state, control, **kwargs):
        callbacks = tuple(handler.callbacks)
        cached = live.get(event)
        if cached is None or cached[0] != callbacks or event == "on_train_begin":
            cached = live[event] = (callbacks, _live(callbacks, event))
        try:
            for callback, ours in cached[1]:
                if ours:
                    open_span()
                else:
                    close_span()
                result = getattr(callback, event)(
                    args,
                    state,
                    control,
                    model=handler.model,
                    processing_class=handler.processing_class,
                    optimizer=handler.optimizer,
                    lr_scheduler=handler.lr_scheduler,
                    train_dataloader=handler.train_dataloader,
                    eval_dataloader=handler.eval_dataloader,
                    **kwargs,
                )
                if result is not None:  # (a callback may leave `control` as it is and return None)
                    control = result
        finally:
            close_span()
        return control

    handler.call_event = call_event
