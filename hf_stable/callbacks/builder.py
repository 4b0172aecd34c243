"""`build_callbacks(cfg, args)`: the monitors and guards a recipe config asks for, in hook order."""

from __future__ import annotations


def build_callbacks(cfg, args=None) -> list:
    """Every hf_stable callback enabled by `cfg` (a RunConfig). Users with their own Trainer can call
    this with a RunConfig, or instantiate the callbacks directly."""
    callbacks: list = []
    stability = cfg.stability
    if stability.monitors.enabled:
        from hf_stable.callbacks.monitors import build_monitors

        callbacks += build_monitors(stability.monitors)
    if stability.guards.enabled:
        from hf_stable.callbacks.guards import build_guards

        callbacks += build_guards(stability.guards, training=cfg.training)
    from hf_stable.callbacks.monitors.attention_monitor_callback import build_attention_callbacks

    callbacks += build_attention_callbacks(cfg.attention)
    return callbacks
