"""`build_callbacks(cfg, args)`: every callback the recipe adds to the Trainer, in hook order."""

from __future__ import annotations

from hf_stable.callbacks.checkpoint_marker import CheckpointMarker
from hf_stable.callbacks.compact_printer import CompactPrinter
from hf_stable.callbacks.guards import build_guards
from hf_stable.callbacks.guards.qk_clip_callback import QKClipCallback
from hf_stable.callbacks.monitors import CompileMonitor, build_monitors
from hf_stable.callbacks.monitors.attention_monitor_callback import IMPLEMENTATION, AttentionMonitorCallback
from hf_stable.callbacks.objective_notice import ObjectiveNotice
from hf_stable.callbacks.preemption_callback import PreemptionCallback
from hf_stable.callbacks.spike_forensics import build_forensics
from hf_stable.core.engine import refuse_fsdp1


def build_attention_callbacks(cfg) -> list:
    """The attention callbacks an `AttentionConfig` asks for (none unless implementation is 'hf_stable')."""
    if cfg.implementation != IMPLEMENTATION:
        return []
    callbacks: list = []
    if cfg.monitor_interval > 0:
        callbacks.append(AttentionMonitorCallback(cfg))
    if cfg.qk_clip:
        callbacks.append(QKClipCallback(cfg))
    return callbacks


def runtime_callbacks(runtime) -> list:
    """Preemption handling (`runtime.preemption`), then the checkpoint marker (it must run last in `on_save`)."""
    return [PreemptionCallback(runtime.preemption), CheckpointMarker()]


def build_callbacks(cfg, args=None, records=None) -> list:
    """Every callback the recipe adds, for `Trainer(callbacks=...)`: the monitors, the guards, the attention
    callbacks, spike forensics (given `records`), preemption handling, the checkpoint marker and, when `args.disable_tqdm`, the one-line
    `CompactPrinter` (`order_for_reporting`, which `StableTrainer` calls, then drops the Trainer's own printer).

    Args:
        cfg: a `RunConfig`.
        args: the run's `TrainingArguments` (optional; `disable_tqdm` is read, and an FSDP1 config refused).
        records: the `RecordTable` of the training data (`build_data(...).records`); with it, spike forensics
            names the records behind bad steps and quarantines them (`data.quarantine`, `data.screen`).

    Raises:
        ConfigError: `args` (or the launcher's environment) asks for FSDP1 (`core.engine.refuse_fsdp1`).

    Example:
        >>> trainer = StableTrainer(model=model, args=args, callbacks=[my_callback, *build_callbacks(cfg, args)])
    """
    if args is not None:  # before the Trainer: accelerate's FSDP1 set-up would fail first on CPU, less clearly
        refuse_fsdp1(args)
    stability = cfg.stability
    callbacks: list = []
    callbacks += build_monitors(stability.monitors)  # empty when monitors.enabled is false
    if args is not None and getattr(args, "torch_compile", False):
        callbacks.append(CompileMonitor())  # compile/* counts in the logs; a warning when it keeps recompiling
    callbacks += build_guards(stability.guards, training=cfg.training)  # likewise
    callbacks += build_attention_callbacks(cfg.attention)
    if records is not None:
        callbacks += build_forensics(cfg.data, records, callbacks)  # bad steps -> culprit records, quarantine
    callbacks += runtime_callbacks(cfg.runtime)
    callbacks.append(ObjectiveNotice())  # a TRL preference / RL trainer without `stabilize`: says which loss is judged
    if args is not None and getattr(args, "disable_tqdm", False):
        callbacks.append(CompactPrinter())
    return callbacks
