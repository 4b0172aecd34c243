"""`ThroughputMonitor`: tokens/s and the time spent waiting for the dataloader versus computing.

Timing points in the Trainer loop: the batches of an optimizer step are fetched right before `on_step_begin`,
and after `on_step_end` come logging, evaluation and saving (each followed by its callback). So
`wait = on_step_begin - max(previous on_step_end, on_log, on_evaluate, on_save)` is time spent getting data
(eval and checkpoint time excluded), and `compute = on_step_end - on_step_begin` the forward/backward/optimizer
time. On a GPU the CPU runs ahead of the device between syncs; the gradient monitors' one sync per step makes
`compute` include the backward pass. Tokens come from `StepTap` (input shape, padding included).

Over each logging interval, times and tokens are summed over ranks: tokens/s is the whole job's rate, the ratio
is mean wait / mean compute. Ratio above `mild_ratio` (1.2) → warning, above `severe_ratio` (2.5) → error.
"""

from __future__ import annotations

import time

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.config.stability import ThroughputMonitorConfig
from hf_stable.core.monitor_utils import AlertGate, collective_device, reduce_host, world_size
from hf_stable.core.step_tap import StepTap, StepTapUser


class ThroughputMonitor(StepTapUser, StabilityCallback):
    """Logs `perf/tokens_per_s`, `perf/data_wait_ratio`, `perf/step_time_s`, `perf/data_wait_s`; event
    `data_stall` (warning when mild, error when severe).

    Args:
        config: a `ThroughputMonitorConfig` (default `ThroughputMonitorConfig()`; every field is documented there and in
            docs/CONFIG.md).
        **overrides: `ThroughputMonitorConfig` fields to change, e.g. `ThroughputMonitor(mild_ratio=1.5)`.

    Example:
        >>> ThroughputMonitor(mild_ratio=1.5)
    """

    def __init__(self, config: ThroughputMonitorConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(ThroughputMonitorConfig, config, overrides)
        self._gate = AlertGate(cfg.cooldown_steps)
        self._totals = {"tokens": 0.0, "wait": 0.0, "compute": 0.0, "steps": 0.0}
        self._interval = dict.fromkeys(self._totals, 0.0)
        self._ready: float | None = None
        self._begin: float | None = None
        self._wait = 0.0
        self._seen = 0
        self._device = None
        self._tap: StepTap | None = None

    def state_dict(self) -> dict:
        return {"totals": dict(self._totals), "gate": self._gate.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._totals.update({k: float(v) for k, v in state.get("totals", {}).items()})
        self._gate.load_state_dict(state.get("gate", {}))

    # --- decisions (pure) -------------------------------------------------------------------------
    def observe(self, step: int, tokens: float, wait_s: float, compute_s: float, steps: float) -> list[dict]:
        """Judge one interval: totals over `steps` timed steps (already summed over ranks)."""
        if steps <= 0 or compute_s <= 0:
            return []
        ranks = world_size()
        ratio = wait_s / compute_s
        metrics = {
            "perf/tokens_per_s": tokens / ((wait_s + compute_s) / ranks),
            "perf/data_wait_ratio": ratio,
            "perf/step_time_s": (wait_s + compute_s) / steps,
            "perf/data_wait_s": wait_s / steps,
        }
        self.record(metrics)
        if steps < self.min_steps or ratio <= self.mild_ratio:
            return []
        severe = ratio > self.severe_ratio
        suppressed = self._gate.allow(step, "data_stall")
        if suppressed is None:
            return []
        level = "severe" if severe else "mild"
        return [
            self.event(
                step,
                "data_stall",
                f"{level} data stall: waiting for the dataloader {ratio:.2f}x as long as computing over the last "
                f"{steps:.0f} steps (more dataloader_num_workers, pin_memory, pre-tokenize, or packing?)",
                value=ratio,
                threshold=self.severe_ratio if severe else self.mild_ratio,
                severity="error" if severe else "warning",
            )
        ]

    # --- Trainer hooks ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        self._device = collective_device(args)
        # steps already made count as seen: the untimed warm-up is the run's first steps, not a resume's (a resumed
        # run's totals then continue exactly where the uninterrupted run's would be)
        self._seen, self._ready, self._begin = state.global_step, None, None
        self._interval = dict.fromkeys(self._totals, 0.0)
        self._use_step_tap(model if self.enabled else None)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        super().on_step_begin(args, state, control, model=model, **kwargs)  # resets the shared StepTap
        if not self.enabled:
            return
        now = time.perf_counter()
        self._wait = now - self._ready if self._ready is not None else 0.0
        self._begin = now

    def on_step_end(self, args, state, control, **kwargs):
        if self.enabled and self._begin is not None:
            now = time.perf_counter()
            self._seen += 1
            if self._seen > self.skip_first_steps:
                tokens = float(self._tap.tokens) if self._tap is not None else 0.0
                for key, value in (
                    ("tokens", tokens),
                    ("wait", self._wait),
                    ("compute", now - self._begin),
                    ("steps", 1.0),
                ):
                    self._interval[key] += value
            if control.should_log:
                keys = list(self._interval)
                summed = dict(
                    zip(keys, reduce_host([self._interval[k] for k in keys], "sum", self._device), strict=False)
                )
                for k in keys:
                    self._totals[k] += summed[k]
                self.observe(state.global_step, summed["tokens"], summed["wait"], summed["compute"], summed["steps"])
                self._interval = dict.fromkeys(keys, 0.0)
            self._ready = time.perf_counter()
        super().on_step_end(args, state, control, **kwargs)

    def _mark_ready(self) -> None:
        self._ready = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        self._mark_ready()

    def on_evaluate(self, args, state, control, **kwargs):
        self._mark_ready()

    def on_save(self, args, state, control, **kwargs):
        self._mark_ready()
