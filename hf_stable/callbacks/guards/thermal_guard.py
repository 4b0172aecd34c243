"""`ThermalGuard`: while the hottest GPU is at or above `hot_c`, accumulate fewer micro-batches (8 -> 6) with the
LR scaled alike (x 6/8, linear rule); restore both once it is below `cool_c` (hysteresis).

Less accumulation per optimizer step means more frequent (smaller) steps and shorter bursts between the
optimizer's host work — a mild load cut that keeps training going instead of letting the clock throttle. The
temperature comes from NVML (the `nvml` extra, like `HardwareMonitor`), max-reduced over ranks every
`check_every` steps so every rank switches together. Without NVML or CUDA on any rank the guard is a no-op (it
says so once). Tests inject a temperature source.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.accumulation_control import AccumulationControl
from hf_stable.config.guards import ThermalConfig
from hf_stable.core.monitor_utils import collective_device
from hf_stable.core.rank_agreement import agree
from hf_stable.import_utils import is_nvml_available


def nvml_temperature() -> Callable[[], float] | None:
    """A reader of this process's GPU temperature (C) through NVML, or None when NVML/CUDA is unavailable."""
    if not torch.cuda.is_available() or not is_nvml_available():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    except Exception:  # noqa: BLE001 - a broken driver must not stop training
        return None
    return lambda: float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))


class ThermalGuard(StabilityCallback):
    """Requests `hot_ratio` x the target accumulation while hot; events `thermal_throttle` / `thermal_restore`.

    Args:
        accumulation: the `AccumulationControl` (listed after this guard; its `lr_rule` should be "linear"
            for LR x 6/8).
        config: a `ThermalConfig` (default `ThermalConfig()` switched on; every field is documented there and
            in docs/CONFIG.md; its `lr_rule` is the `AccumulationControl`'s business).
        temperature_fn: a callable returning this rank's temperature in C (default: NVML; None result = unknown).
        **overrides: `ThermalConfig` fields to change, e.g. `ThermalGuard(acc, hot_c=75, cool_c=70)`.

    Example:
        >>> lr = LRControl(); acc = AccumulationControl(lr, target=8, lr_rule="linear")
        >>> callbacks = [ThermalGuard(acc, hot_c=75, cool_c=70), acc, lr]
    """

    def __init__(
        self,
        accumulation: AccumulationControl,
        config: ThermalConfig | None = None,
        *,
        temperature_fn: Callable[[], float | None] | None = None,
        **overrides,
    ):
        super().__init__()
        self._use_config(ThermalConfig, config, overrides)
        self.accumulation = accumulation
        self.temperature_fn = temperature_fn
        self._reader: Callable[[], float | None] | None = None
        self._hot = False
        self._device = None
        self.last_temperature: float | None = None

    def state_dict(self) -> dict:
        return {"hot": self._hot}

    def load_state_dict(self, state: dict) -> None:
        self._hot = bool(state.get("hot", False))

    @property
    def hot(self) -> bool:
        return self._hot

    def observe(self, step: int, temperature: float) -> None:
        """Apply the hysteresis to one (rank-agreed) reading."""
        self.last_temperature = temperature
        self.record({"hw/thermal_guard_temp_c": temperature})
        if not self._hot and temperature >= self.hot_c:
            self._hot = True
            self.accumulation.request("thermal", self.hot_ratio)
            self.event(
                step,
                "thermal_throttle",
                f"GPU at {temperature:.0f} C >= {self.hot_c:g} C: accumulation x "
                f"{self.hot_ratio:g} with the LR scaled alike until below {self.cool_c:g} C",
                value=temperature,
                threshold=self.hot_c,
                severity="warning",
            )
        elif self._hot and temperature < self.cool_c:
            self._hot = False
            self.accumulation.request("thermal", 1.0)
            self.event(
                step,
                "thermal_restore",
                f"GPU at {temperature:.0f} C < {self.cool_c:g} C: full accumulation and LR restored",
                value=temperature,
                threshold=self.cool_c,
                severity="info",
            )

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if not self.enabled:
            return
        self._device = collective_device(args)
        self._reader = self.temperature_fn or nvml_temperature()
        # Every rank must join the same collectives: off everywhere unless every rank can read a temperature.
        missing = agree([float(self._reader is None)], self._device)[0]
        if missing:
            self._reader = None
            self.event(
                state.global_step,
                "guard_off",
                "thermal guard is a no-op: no NVML temperature on every rank "
                '(needs CUDA and pip install "hf-stable[nvml]")',
                severity="info",
            )
        if self._hot:  # resumed while hot
            self.accumulation.request("thermal", self.hot_ratio)

    def on_step_end(self, args, state, control, **kwargs):
        if self.enabled and self._reader is not None and state.global_step % self.check_every == 0:
            try:
                value = self._reader()
            except Exception:  # noqa: BLE001 - a failed read is an unknown temperature, not a crash
                value = None
            reading = -math.inf if value is None or not math.isfinite(value) else float(value)
            temperature = agree([reading], self._device)[0]
            if math.isfinite(temperature):
                self.observe(state.global_step, temperature)
        super().on_step_end(args, state, control, **kwargs)
