"""`AccumulationControl`: change gradient accumulation between optimizer steps, correctly, inside the stock Trainer.

The Trainer re-reads `args.gradient_accumulation_steps` at every optimizer step, fetches that many micro-batches
and normalises by their supervised tokens (`num_items_in_batch`), so changing it between steps keeps the
per-token loss exact (verified in `tests/test_guards_accumulation.py`). Two constraints:

* **Alignment**: the Trainer steps at `(micro_index + 1) % accumulation == 0` counted from the epoch start, so a new
  value `k` applies only at a step end where the epoch's consumed micro-batches are a multiple of `k` (waits a
  step or two otherwise).
* **Loop size**: the run starts at accumulation 1 (`guard_training_overrides`; a start value > 1 is refused), and
  the Trainer plans epochs for 1 only. `StableTrainer` feeds such a run from an `EpochStreamSampler` sized by
  `planned_micro_batches`; with the stock Trainer the guard checks the data holds enough and else raises a
  ConfigError naming the numbers.

The LR factor `accumulation` (in `LRControl`) compensates a smaller batch: `(k / target) ** 0.5` or `k / target`
(`optim.rescale_lr`). Resume: the micro-batches really consumed are saved (`micro_batches`) and `StableTrainer`
skips exactly those (the stock Trainer assumes `global_step x accumulation`). DeepSpeed keeps its own accumulation
(the guard says it is off).
"""

from __future__ import annotations

import math

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.lr_control import LRControl
from hf_stable.config.guards import BatchWarmupConfig
from hf_stable.distributed import sharded_training
from hf_stable.errors import ConfigError
from hf_stable.optim.scaling import rescale_lr


class AccumulationControl(StabilityCallback):
    """Applies the accumulation the guards request (aligned), with the LR compensation; event
    `accumulation_changed`, metric `batch/accumulation`.

    Args:
        lr_control: the `LRControl` holding the `accumulation` factor.
        target: the full accumulation (the recipe's `training.gradient_accumulation_steps`).
        lr_rule: "sqrt", "linear" or "none".
        enabled: when False the callback does nothing.

    Raises:
        ConfigError: at train start when `max_steps <= 0`, when TrainingArguments.gradient_accumulation_steps
            is not 1, or when the data cannot feed the planned micro-batches.

    Example:
        >>> lr = LRControl()
        >>> acc = AccumulationControl(lr, target=8)
        >>> callbacks = [BatchWarmupGuard(acc), acc, lr]     # TrainingArguments(gradient_accumulation_steps=1)
    """

    def __init__(
        self, lr_control: LRControl, target: int = 1, lr_rule: str = BatchWarmupConfig.lr_rule, enabled: bool = True
    ):
        super().__init__(enabled)
        self.lr_control = lr_control
        self.target = max(1, int(target))
        self.lr_rule = lr_rule
        self._requests: dict[str, float] = {}
        self._plans: dict[str, object] = {}
        self._current: int | None = None
        self._waiting_since: int | None = None
        self._args = None
        self._start_accumulation = 1  # TrainingArguments' value at train start, put back at train end
        self._off = False
        self._micro_batches = 0  # micro-batches consumed per rank since the run started (saved for resume)
        self._saved_current: int | None = None
        self._exact_resume = False  # StableTrainer resumed the data at `micro_batches`
        self.history: list[tuple[int, int]] = []  # (step at which it applies from, accumulation)

    # --- requests ---------------------------------------------------------------------------------------
    def request(self, name: str, ratio: float) -> None:
        """Ask for `ratio` x the target accumulation (1.0 withdraws the request)."""
        if not 0 < ratio <= 1:
            raise ValueError(f"accumulation ratio for {name!r} must be in (0, 1], got {ratio}")
        if ratio == 1.0:
            self._requests.pop(name, None)
        else:
            self._requests[name] = float(ratio)

    def add_plan(self, name: str, fn) -> None:
        """`fn(step) -> ratio` the requester will ask for after `step` completed steps (for the capacity check;
        a requester without a plan counts as 1.0, the full target)."""
        self._plans[name] = fn

    def planned_micro_batches(self, start: int, end: int) -> int:
        """Micro-batches steps start+1 .. end would consume per rank if every plan holds."""
        total = 0
        for step in range(start, end):
            ratio = math.prod(fn(step) for fn in self._plans.values()) if self._plans else 1.0
            total += max(1, min(self.target, round(self.target * ratio)))
        return total

    @property
    def desired(self) -> int:
        value = self.target * math.prod(self._requests.values()) if self._requests else self.target
        return max(1, min(self.target, round(value)))

    @property
    def current(self) -> int | None:
        return self._current

    def state_dict(self) -> dict:
        return {"requests": dict(self._requests), "current": self._current, "micro_batches": self._micro_batches}

    def load_state_dict(self, state: dict) -> None:
        self._requests = {k: float(v) for k, v in state.get("requests", {}).items()}
        self._saved_current = state.get("current")
        self._micro_batches = int(state.get("micro_batches", 0))

    # --- the data plan (read by StableTrainer) ---------------------------------------------------------
    @classmethod
    def find(cls, callbacks) -> AccumulationControl | None:
        """The enabled `AccumulationControl` among `callbacks`, if any."""
        return next((cb for cb in callbacks if isinstance(cb, cls) and cb.enabled), None)

    def changes_accumulation(self, args) -> bool:
        """Whether this run's accumulation is driven here (enabled, a fixed step count, not under DeepSpeed)."""
        deepspeed = (sharded_training(args) or "").startswith("DeepSpeed")
        return self.enabled and not deepspeed and args.max_steps is not None and args.max_steps > 0

    @classmethod
    def saved_micro_batches(cls, state) -> int | None:
        """Micro-batches per rank the run saved in `state` (a TrainerState loaded from a checkpoint) had consumed."""
        from hf_stable.callbacks.base import STATE_KEY

        saved = ((state.stateful_callbacks or {}).get(STATE_KEY) or {}).get(cls.__name__) or {}
        value = saved.get("micro_batches")
        return int(value) if value is not None else None

    def resume_exact(self) -> None:
        """Called by the Trainer that resumed the data at exactly `saved_micro_batches`: keep the saved accumulation."""
        self._exact_resume = True

    # --- application ----------------------------------------------------------------------------------------
    def _set(self, step: int, value: int) -> None:
        old = self._current
        self._current = value
        self._args.gradient_accumulation_steps = value
        factor = 1.0 if self.lr_rule == "none" else rescale_lr(1.0, self.target, value, self.lr_rule)
        self.lr_control.set_factor("accumulation", factor)
        self.history.append((step + 1, value))
        self.record({"batch/accumulation": float(value)})
        if old is not None and old != value:
            self.event(
                step,
                "accumulation_changed",
                f"gradient accumulation {old} -> {value} from step {step + 1} (target {self.target}; "
                f"requests {self._requests or 'none'}); LR factor {self.lr_control.factor('accumulation'):.3g}",
                value=value,
                threshold=self.target,
                severity="info",
                previous=old,
            )

    @staticmethod
    def _consumed(state, train_dataloader) -> int | None:
        """Micro-batches consumed per rank since the start, from the Trainer's `epoch` (epochs + micro / length)."""
        try:
            n = len(train_dataloader)
        except TypeError:
            return None
        return round(state.epoch * n) if n else None

    @classmethod
    def _micro_in_epoch(cls, state, train_dataloader) -> int | None:
        consumed = cls._consumed(state, train_dataloader)
        return None if consumed is None else consumed % len(train_dataloader)

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if not self.enabled:
            return
        self._args = args
        self._start_accumulation = args.gradient_accumulation_steps
        self._off = (sharded_training(args) or "").startswith("DeepSpeed")
        if self._off:
            self.event(
                state.global_step,
                "guard_off",
                "accumulation control is off under DeepSpeed (its engine owns gradient accumulation)",
                severity="info",
            )
            return
        if args.max_steps is None or args.max_steps <= 0:
            raise ConfigError(
                "training.max_steps: batch warmup / the thermal guard change gradient accumulation "
                "during the run and need a fixed number of optimizer steps; set training.max_steps > 0"
            )
        if state.global_step == 0:
            self._micro_batches = 0
            self._check_capacity(args, kwargs.get("train_dataloader"))
        # A fresh run starts at micro-batch 0 (aligned for any value); a run resumed at the exact data position
        # continues with the accumulation it had; any other resume at 1 until aligned.
        self._current = None
        if state.global_step == 0:
            start = self.desired
        elif self._exact_resume and self._saved_current:
            start = int(self._saved_current)
        else:
            start = 1
        self._exact_resume = False
        self._set(state.global_step, start)

    def _check_capacity(self, args, train_dataloader) -> None:
        if args.gradient_accumulation_steps != 1:
            raise ConfigError(
                f"training.gradient_accumulation_steps: got {args.gradient_accumulation_steps} in TrainingArguments; "
                "with batch warmup / the thermal guard it must be 1 (the guard sets the real value; pass the target "
                "as build_guards(cfg, training) / AccumulationControl(target=...)). guard_training_overrides() "
                "does this for the recipe."
            )
        try:
            per_epoch = len(train_dataloader)
        except TypeError:
            return  # an iterable dataset: the Trainer loops over it as often as needed
        epochs = math.ceil(args.max_steps / max(per_epoch, 1))
        have, need = epochs * per_epoch, self.planned_micro_batches(0, args.max_steps)
        if need > have:
            raise ConfigError(
                f"training.max_steps: {args.max_steps} steps with accumulation up to {self.target} need {need} "
                f"micro-batches per rank, but the Trainer plans {epochs} epoch(s) of {per_epoch} (it sizes epochs "
                f"for accumulation 1 when the accumulation changes during the run). Train with "
                "hf_stable.trainer.StableTrainer (the recipe's Trainer: it plans the data for a changing "
                f"accumulation), or repeat the training set at least {math.ceil(need / per_epoch)}x "
                "(datasets.concatenate_datasets([ds] * k)), lower max_steps, or turn batch warmup / the thermal "
                "guard off."
            )

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        if self.enabled and not self._off and self._args is not None:
            consumed = self._consumed(state, train_dataloader)
            if consumed is not None:
                self._micro_batches = consumed
            want = self.desired
            if want != self._current:
                micro = self._micro_in_epoch(state, train_dataloader)
                if micro is not None and micro % want == 0:
                    self._set(state.global_step, want)
                    self._waiting_since = None
                elif self._waiting_since is None:
                    self._waiting_since = state.global_step
            self.record({"batch/accumulation": float(self._current)})
        super().on_step_end(args, state, control, train_dataloader=train_dataloader, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.enabled and not self._off and self._args is not None:
            args.gradient_accumulation_steps = self._start_accumulation  # a later train() plans as this one did
        super().on_train_end(args, state, control, **kwargs)
