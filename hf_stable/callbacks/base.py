"""`StabilityCallback`: the base of every hf_stable monitor and guard.

What it adds to `transformers.TrainerCallback`:

* **Metrics in the Trainer's own logs.** `self.record({...})` buffers namespaced metrics
  (`grad/norm_global`, `mem/reserved_gib`); at the next `on_log` they are merged into the logs dict and
  into the matching `state.log_history` entry, so TensorBoard / W&B / trainer_state.json all get them. The
  reporting integrations must then run after our callbacks: `StableTrainer` orders them so, the stock Trainer
  needs `order_for_reporting(trainer)` (see `ordering`). Callbacks are never moved otherwise: a user's callback
  listed before ours runs before ours.
* **Events.** `self.event(...)` appends to `stability_events.jsonl` (main process only) and logs.
* **Resume.** `state_dict()` / `load_state_dict()` of JSON-safe values. The state is written into
  `TrainerState.stateful_callbacks["hf_stable"][state_key]` so every checkpoint's trainer_state.json has it, and
  it is restored in place at `on_train_begin` when resuming. Under `StableTrainer` it is written just before each
  checkpoint (and at train end), not every step (`writes_state_at_checkpoints`); in a stock Trainer, which cannot
  tell us before it saves, at every step's end. We do not
  use transformers' `ExportableState` replacement, which rebuilds a *new* callback from constructor
  args: it would drop configuration objects and the links between monitors and guards.

Subclasses keep configuration in public attributes and runtime state in `_private` ones. A callback with a
config section takes it as its first argument after the callbacks it depends on (`SkipGuard(SkipConfig(...))`,
or keywords: `SkipGuard(window=20)`); `_use_config` keeps it as `self.config` and its fields as attributes, so
each default is declared once, in the config dataclass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainerCallback

from hf_stable.config.fields import config_from
from hf_stable.core.engine import StepEngine, refuse_fsdp1
from hf_stable.core.events import write_event
from hf_stable.core.grad_stats import begin_step

STATE_KEY = "hf_stable"


class StabilityCallback(TrainerCallback):
    """Base class of hf_stable callbacks.

    Args:
        enabled: when False the callback does nothing at all.
    """

    # Set by `StableTrainer`, which writes every callback's state just before it saves a checkpoint.
    writes_state_at_checkpoints = False

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._pending: dict[str, float] = {}
        self._output_dir: str | None = None
        self._is_main = True
        self._events: list[dict] = []

    def _use_config(self, cls, config, overrides: dict) -> Any:
        """Resolve the config (see `config_from`), keep it as `self.config` and each field as an attribute."""
        cfg = config_from(cls, config, overrides)
        self.config = cfg
        for f in dataclasses.fields(cfg):
            setattr(self, f.name, getattr(cfg, f.name))
        return cfg

    # --- identity and state -------------------------------------------------------------
    @property
    def state_key(self) -> str:
        return type(self).__name__

    def state_dict(self) -> dict:
        """JSON-safe runtime state to save in checkpoints. Override in subclasses."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned. Override in subclasses."""

    # --- helpers for subclasses ---------------------------------------------------------
    def record(self, metrics: dict[str, float]) -> None:
        """Buffer metrics for the next Trainer log line (later values overwrite earlier ones)."""
        self._pending.update(metrics)

    def event(self, step: int, kind: str, message: str, **fields: Any) -> dict:
        """Write a stability event (main process) and keep it in memory (every process)."""
        ev = write_event(
            self._output_dir,
            step=step,
            kind=kind,
            message=message,
            source=self.state_key,
            is_main=self._is_main,
            **fields,
        )
        self._events.append(ev)
        return ev

    @property
    def events(self) -> list[dict]:
        return list(self._events)

    # --- Trainer hooks --------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        refuse_fsdp1(args, kwargs.get("model"))  # FSDP1's flat shards would be judged as whole gradients
        self._output_dir = args.output_dir
        self._is_main = state.is_world_process_zero
        saved = (state.stateful_callbacks or {}).get(STATE_KEY, {}).get(self.state_key)
        if saved is not None and state.global_step > 0:
            self.load_state_dict(saved)

    def engine_unhosted(self, state, model) -> bool:
        """True when the model's engine makes the step inside backward (DeepSpeed) and no `StableTrainer` runs the
        callbacks' pre-step before it: `on_pre_optimizer_step` then comes after the update, with the gradients gone,
        so gradient monitors and guards can neither read nor skip it. Said once per run (one `guard_off` event)."""
        engine = StepEngine.of(model)
        if not engine.owns_step or engine.hosted:
            return False
        if not engine.unhosted_said:
            engine.unhosted_said = True
            self.event(
                state.global_step,
                "guard_off",
                f"under {engine.describe()} the stock Trainer calls on_pre_optimizer_step after DeepSpeed has made "
                "the step: hf_stable's gradient monitors and guards (statistics, NaN location, skip, rollback, "
                "clipping) cannot see or skip it and do nothing; train with hf_stable.trainer.StableTrainer (the "
                "recipe does), which runs them between DeepSpeed's backward and its step",
                severity="warning",
            )
        return True

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        begin_step(model)  # the shared gradient statistics gather afresh this step (rank-agreed, see grad_stats)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.writes_state_at_checkpoints:
            self._save_into(state)

    def on_train_end(self, args, state, control, **kwargs):
        self._save_into(state)

    def _save_into(self, state) -> None:
        if state.stateful_callbacks is None:
            state.stateful_callbacks = {}
        state.stateful_callbacks.setdefault(STATE_KEY, {})[self.state_key] = self.state_dict()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._pending or logs is None:
            return
        logs.update(self._pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        self._pending = {}
