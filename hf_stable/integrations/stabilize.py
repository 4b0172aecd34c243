"""`stabilize(trainer, cfg=None)`: hf_stable's monitors and guards on a trainer the user already built.

One line for any `Trainer` subclass (`Trainer`, TRL's `SFTTrainer`, `DPOTrainer`, `KTOTrainer`, `GRPOTrainer`,
`RLOOTrainer` ...), after the user built it and before `train()`:

* the instance's class becomes a subclass of `StableTrainer` and of its own class (``StableDPOTrainer``), so it gets
  what `StableTrainer` gives a plain `Trainer`: the step's pre-clip gradient norm and the ``max_grad_norm`` clip
  from the shared statistics (TRL's default ``max_grad_norm=1.0`` no longer hides a spike from the guards), and the
  engine seam (DeepSpeed runs the callbacks' pre-step between its backward and its step; FSDP2 shards);
* `build_callbacks(cfg, trainer.args)` is added in reporting order (the reporters after them);
* for a trainer whose objective is not the model's LM loss (`trainer_families`), the step is bound to what the
  trainer's `compute_loss` returns: the guards, the loss monitor and every re-run judge the DPO / KTO / GRPO loss,
  with the rules that fit it (`TrainerFamily.configure`);
* for a TRL trainer that computes signals of its own (DPO, KTO, GRPO, RLOO: reward, KL, entropy, margins ...), a
  `PostTrainMonitor` reads them before each optimizer step, logs them as ``posttrain/*`` and names what they show
  (a reward function returning inf/NaN, no learning signal): docs/post-training.md;
* for GRPO / RLOO, a step whose log-probs are non-finite or whose importance ratio explodes is skipped on every rank
  (`rl_damage`, the skip guard's ``damaged`` rule).
* for a DPO / KTO trainer, every batch carries its records' dataset indices (`forensics.pairs`) and a skipped step
  names them (`PairForensics`: a ``step_pairs`` event and ``skipped_pairs.jsonl``; ``file:line`` with `records`).

Calling it again is a no-op; a trainer that already holds hf_stable's callbacks (``callbacks=build_callbacks(...)``)
keeps them and is only bound. Returns the trainer.

Example:
    >>> trainer = hf_stable.stabilize(DPOTrainer(model=model, args=DPOConfig(...), train_dataset=ds))
    >>> trainer.train()
"""

from __future__ import annotations

import weakref

from transformers import Trainer

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.builder import build_callbacks
from hf_stable.callbacks.guards import SkipGuard
from hf_stable.callbacks.monitors.post_train_monitor import PostTrainMonitor
from hf_stable.callbacks.ordering import order_for_reporting
from hf_stable.callbacks.pair_forensics import PairForensics
from hf_stable.compat import attn_implementation
from hf_stable.config import RunConfig
from hf_stable.config.attention import ATTN_IMPLEMENTATION
from hf_stable.core.engine import refuse_fsdp1
from hf_stable.core.step_tap import StepTap
from hf_stable.forensics.pairs import tag_records
from hf_stable.integrations import rl_damage
from hf_stable.integrations.trainer_families import TrainerFamily, family_of
from hf_stable.trainer import StableTrainer

_STABLE_CLASSES: dict[type, type] = {}


def stable_class(cls: type) -> type:
    """`cls` with `StableTrainer`'s methods first in its MRO (made once per class)."""
    if issubclass(cls, StableTrainer):
        return cls
    if cls is Trainer:
        return StableTrainer
    made = _STABLE_CLASSES.get(cls)
    if made is None:
        name = f"Stable{cls.__name__}"
        made = type(name, (StableTrainer, cls), {"__module__": __name__, "__qualname__": name, "__doc__": cls.__doc__})
        _STABLE_CLASSES[cls] = made
    return made


def stabilize(trainer: Trainer, cfg: RunConfig | None = None, records=None) -> Trainer:
    """Attach hf_stable to a built `trainer` (any `transformers.Trainer` subclass); idempotent.

    Args:
        trainer: the trainer, built and not yet trained.
        cfg: a `RunConfig` (default `RunConfig()`); its guard rules are adapted to the trainer's objective.
        records: for a DPO / KTO trainer, where its train dataset's records came from, so a skipped step names them
            by ``file:line``: the JSONL file it was read from (record ``i`` is its ``i``-th non-empty line) or one
            ``where`` string per record. Without it a skipped step names the records by their dataset index.

    Returns:
        The same trainer object.

    Raises:
        ConfigError: the arguments ask for FSDP1 (`core.engine.refuse_fsdp1`).

    Example:
        >>> trainer = stabilize(GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds))
    """
    if getattr(trainer, "_hf_stable_family", None) is not None:
        return trainer
    refuse_fsdp1(trainer.args)
    family = family_of(trainer)
    cfg = family.configure(cfg if cfg is not None else _default_config(trainer))
    had_stable = isinstance(trainer, StableTrainer)
    trainer.__class__ = stable_class(type(trainer))
    tagged = family.name == "preference" and tag_records(trainer)  # before _stable_setup asks for the ids
    # a PostTrainMonitor of the user's (its thresholds) is bound below; it does not stand for build_callbacks
    if not any(_ours(cb) and not isinstance(cb, PostTrainMonitor) for cb in trainer.callback_handler.callbacks):
        for callback in build_callbacks(cfg, trainer.args):
            trainer.add_callback(callback)
    if had_stable:
        trainer._stable_setup(trainer.training_loss)  # the user's training_loss stays; the order is redone
    else:
        trainer._stable_setup(cfg.training_loss)
    if not family.model_loss and trainer.model is not None:
        StepTap.shared(trainer.model).judge_objective(_objective_of(trainer, family))
    _read_signals(trainer, family)
    if family.signals == "generation":  # GRPO / RLOO: a step with damaged log-probs is skipped (`rl_damage`)
        rl_damage.watch(trainer)
    if tagged:
        _name_pairs(trainer, records)
    trainer._hf_stable_family = family
    return trainer


def _default_config(trainer: Trainer) -> RunConfig:
    """`RunConfig()` with its attention section following the model the user built: the attention-logit monitor
    and QK-clip need ``attn_implementation="hf_stable"``, which the recipe loads with and a user's model (``sdpa``)
    does not run. Not asked for, they are not built (a healthy run no longer opens with an ``attn_monitor_inactive``
    warning); a `cfg` that asks for them on such a model still says why they are off."""
    cfg = RunConfig()
    impl = attn_implementation(trainer.model) if trainer.model is not None else None
    if impl is not None and impl != ATTN_IMPLEMENTATION:
        cfg.attention.implementation = impl
    return cfg


def _read_signals(trainer: Trainer, family: TrainerFamily) -> None:
    """A `PostTrainMonitor` bound to the signals `trainer` computes itself (its family's `SignalReader`). For a
    generating trainer its reward-spread event replaces `SkipGuard`'s generic zero-gradient warning (same cause,
    said with the numbers and the fix); the guard's no-lockout handling of zero-gradient steps is unchanged."""
    if family.signals is None:
        return
    callbacks = trainer.callback_handler.callbacks
    monitor = next((cb for cb in callbacks if isinstance(cb, PostTrainMonitor)), None)
    if monitor is None:
        monitor = PostTrainMonitor()
        trainer.add_callback(monitor)
        order_for_reporting(trainer)  # the reporters stay after the callbacks whose metrics they write
    monitor.bind(trainer, family)
    if family.signals == "generation" and monitor.enabled:
        for cb in callbacks:
            if isinstance(cb, SkipGuard):
                cb.no_signal_warn_steps = None
                cb.skip_detail = monitor.skipped_rollouts  # a skipped step names its prompts and completions


def _name_pairs(trainer: Trainer, records) -> None:
    """A `PairForensics` listening to the run's `SkipGuard`: a skipped DPO / KTO step names its records."""
    skip = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SkipGuard)), None)
    if skip is None or not skip.enabled:
        return
    trainer.add_callback(PairForensics(trainer, records).attach(skip))
    order_for_reporting(trainer)


def _ours(callback) -> bool:
    """One of hf_stable's own callbacks (a user's `StabilityCallback` subclass does not count)."""
    return isinstance(callback, StabilityCallback) and type(callback).__module__.startswith("hf_stable.")


def _objective_of(trainer: Trainer, family: TrainerFamily):
    """fn(call_args, call_kwargs) -> the trainer's `compute_loss` on recorded trainer-level inputs (a re-run),
    leaving the trainer's logged metrics as they were. Holds the trainer weakly (the tap lives as long as the model)."""
    ref = weakref.ref(trainer)

    def objective(call_args, call_kwargs):
        t = ref()
        if t is None:
            return None
        with family.replay(t):
            return t.compute_loss(t.model, call_kwargs)

    return objective
