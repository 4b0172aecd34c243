"""`AttentionMonitorCallback`: sampled per-layer max attention logit, as metrics and alerts.

Growth of the attention logits precedes a class of divergences (entropy collapse, then loss spikes).
Reading them every step would defeat the fused kernels, so the callback arms the shared `LogitProbe`
only on sampled steps (step 1 and every `interval`-th step); the `hf_stable` attention function feeds it
during that step's forward passes; at `on_step_end` one device→host transfer yields every layer's max.

Metrics: `attn/max_logit/layer_<i>` per layer and `attn/max_logit/max` over layers (raw scaled q·k before
any soft-cap; the value measured *before* a QK-clip of the same step). Alerts (stability events) are level-based:

* `attn_logit_high` when a layer's max logit crosses the level (`logit_alert_threshold`, 100; with
  `attention.softcap` the cap when lower, since a raw logit at the cap is where tanh flattens): once per crossing.
  At 100 a softmax row is one-hot to within e^-60 against any key 60 lower: saturated, its gradient vanishes.
  Measured: healthy runs 7-35 (the embedded default, `make demo`), the rescue benchmark's `attn_logits` case
  540-1,020.
* `attn_logit_growth` when `growth_checks` consecutive samples of a layer each exceed the previous one, the last is
  at least `growth_ratio` times the first *and* at least `logit_growth_min_share` (0.5) of the level: a steady rise
  towards saturation. A rise from 20 to 35 is the ordinary shape of a healthy run's first hundred steps.
"""

from __future__ import annotations

from hf_stable.attention.probe import LogitProbe, get_probe
from hf_stable.callbacks.base import StabilityCallback
from hf_stable.compat import attn_implementation
from hf_stable.config.attention import ATTN_IMPLEMENTATION, AttentionConfig
from hf_stable.config.fields import config_from

IMPLEMENTATION = ATTN_IMPLEMENTATION  # the name the builder and QK-clip check the model for


def sample_step(step: int, interval: int) -> bool:
    """Whether optimizer step `step` (1-based) is sampled: the first one, then every `interval`-th."""
    return interval > 0 and (step == 1 or step % interval == 0)


class AttentionMonitorCallback(StabilityCallback):
    """Logs the sampled per-layer max attention logit and alerts on high or steadily growing values.

    Needs the model to run with `attn_implementation="hf_stable"` (see `hf_stable.attention.register`);
    with another implementation it records one warning event and stays inactive.

    Args:
        config: the `AttentionConfig` section (default `AttentionConfig()`): `monitor_interval` (sample every N
            optimizer steps and step 1; 0 disables), `logit_alert_threshold` (`attn_logit_high` event when a layer's
            max goes above it), `logit_growth_checks` consecutive samples each above the previous make an
            `attn_logit_growth` event provided the last is at least `logit_growth_ratio` x the first and past the
            level `logit_growth_min_share` x the alert level (the event's `threshold`).
        probe: the probe to arm (defaults to the process-wide one the attention function feeds).
        enabled: False makes the callback a no-op.
        **overrides: `AttentionConfig` fields to change, e.g. `AttentionMonitorCallback(monitor_interval=10)`.

    Example:
        >>> register(); model = AutoModelForCausalLM.from_pretrained(p, attn_implementation="hf_stable")
        >>> Trainer(model, args, callbacks=[AttentionMonitorCallback(monitor_interval=10)], ...)
    """

    def __init__(
        self,
        config: AttentionConfig | None = None,
        *,
        probe: LogitProbe | None = None,
        enabled: bool = True,
        **overrides,
    ):
        cfg = config_from(AttentionConfig, config, overrides)
        super().__init__(enabled=enabled and cfg.monitor_interval > 0)
        self.config = cfg
        self.interval = cfg.monitor_interval
        self.alert_threshold = cfg.logit_alert_threshold
        self.growth_checks = cfg.logit_growth_checks
        self.growth_ratio = cfg.logit_growth_ratio
        # the level: the alert threshold, or the soft-cap when that is lower (a raw logit at the cap saturates tanh)
        cap = getattr(cfg, "softcap", None)
        self.level = min(cfg.logit_alert_threshold, cap) if cap else cfg.logit_alert_threshold
        self.alert_threshold = self.level
        self.growth_min_share = cfg.logit_growth_min_share
        self.growth_floor = self.growth_min_share * self.level
        self.probe = probe if probe is not None else get_probe()
        self._active = self.enabled
        self._above: set[int] = set()
        self._history: dict[int, list[float]] = {}
        self._last: dict[int, float] = {}

    def state_dict(self) -> dict:
        return {
            "above": sorted(self._above),
            "history": {str(k): v for k, v in self._history.items()},
            "last": {str(k): v for k, v in self._last.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self._above = {int(k) for k in state.get("above", [])}
        self._history = {int(k): list(v) for k, v in state.get("history", {}).items()}
        self._last = {int(k): float(v) for k, v in state.get("last", {}).items()}

    @property
    def last_maxima(self) -> dict[int, float]:
        """`{layer: max logit}` of the latest sample."""
        return dict(self._last)

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if not self.enabled:
            return
        impl = attn_implementation(kwargs.get("model"))
        self._active = impl == IMPLEMENTATION
        if not self._active:
            self.event(
                state.global_step,
                "attn_monitor_inactive",
                f"the model runs attn_implementation={impl!r}; the attention-logit monitor needs 'hf_stable' "
                "(call hf_stable.attention.register() and load with attn_implementation='hf_stable')",
                severity="warning",
            )

    def on_step_begin(self, args, state, control, **kwargs):
        if self._active and sample_step(state.global_step + 1, self.interval):
            self.probe.arm(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self._active and self.probe.step == step and sample_step(step, self.interval):
            self.probe.disarm()
            maxima = self.probe.layer_maxima()
            if maxima:
                self._observe(step, maxima)
        super().on_step_end(args, state, control, **kwargs)

    def _observe(self, step: int, maxima: dict[int, float]) -> None:
        metrics = {f"attn/max_logit/layer_{i}": v for i, v in maxima.items()}
        metrics["attn/max_logit/max"] = max(maxima.values())
        self.record(metrics)
        self._last = dict(maxima)
        for layer, value in maxima.items():
            if value > self.alert_threshold and layer not in self._above:
                self._above.add(layer)
                self.event(
                    step,
                    "attn_logit_high",
                    f"layer {layer} max attention logit {value:.4g} > the level {self.alert_threshold:g} where softmax "
                    "saturates: attention is collapsing onto single keys (a lower LR, or attention.qk_clip / softcap)",
                    group=f"layer_{layer}",
                    value=value,
                    threshold=self.alert_threshold,
                )
            elif value <= self.alert_threshold:
                self._above.discard(layer)
            history = self._history.setdefault(layer, [])
            if history and value <= history[-1]:
                history.clear()
            history.append(value)
            if len(history) >= self.growth_checks:
                first = history[0]
                if first > 0 and value >= self.growth_ratio * first and value >= self.growth_floor:
                    self.event(
                        step,
                        "attn_logit_growth",
                        f"layer {layer} max attention logit rose over {len(history)} consecutive samples, "
                        f"{first:.4g} -> {value:.4g} (x{value / first:.2f}), past the level {self.growth_floor:g} "
                        f"({self.growth_min_share:g} of {self.level:g}, where softmax saturates)",
                        group=f"layer_{layer}",
                        value=value,
                        threshold=self.growth_floor,
                        growth_ratio=self.growth_ratio,
                    )
                    history.clear()
                else:
                    del history[0]
