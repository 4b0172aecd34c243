"""`HardwareMonitor`: GPU temperature, SM clock, power and utilisation through NVML, at logging steps.

Needs the `nvml` extra (`pynvml`, from nvidia-ml-py) and a CUDA device; otherwise it says once that it is off.
The NVML device is found by the CUDA device's UUID, so `CUDA_VISIBLE_DEVICES` remapping does not mislead it.
Readings are max-reduced over ranks (the hottest GPU is the one that throttles); whether to read at all is agreed
at train start (off on every rank unless every rank has NVML), so no rank enters that collective alone.
"""

from __future__ import annotations

import contextlib
import math

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.config.stability import HardwareMonitorConfig
from hf_stable.core.monitor_utils import AlertGate, collective_device, reduce_host
from hf_stable.distributed import all_reduce_flag
from hf_stable.import_utils import is_nvml_available
from hf_stable.logging import get_logger

logger = get_logger(__name__)
_KEYS = ("hw/gpu_temp_c", "hw/sm_clock_mhz", "hw/power_w", "hw/gpu_util_pct")


class HardwareMonitor(StabilityCallback):
    """Logs `hw/gpu_temp_c`, `hw/sm_clock_mhz`, `hw/power_w`, `hw/gpu_util_pct`; event `gpu_hot`.

    Args:
        config: a `HardwareMonitorConfig` (default `HardwareMonitorConfig()`; every field is documented there and in
            docs/CONFIG.md).
        **overrides: `HardwareMonitorConfig` fields to change, e.g. `HardwareMonitor(temp_alert_c=80)`.

    Example:
        >>> HardwareMonitor(temp_alert_c=80)
    """

    def __init__(self, config: HardwareMonitorConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(HardwareMonitorConfig, config, overrides)
        self._gate = AlertGate(cfg.cooldown_steps)
        self._handle = None
        self._nvml = None
        self._device = None
        self._off_reason: str | None = None

    def state_dict(self) -> dict:
        return {"gate": self._gate.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._gate.load_state_dict(state.get("gate", {}))

    def observe(self, step: int, reading: dict[str, float]) -> list[dict]:
        """Record one reading and alert when the GPU is hot."""
        self.record({k: v for k, v in reading.items() if not math.isnan(v)})
        temp = reading.get("hw/gpu_temp_c", float("nan"))
        if not math.isnan(temp) and temp >= self.temp_alert_c and self._gate.allow(step, "gpu_hot") is not None:
            return [
                self.event(
                    step,
                    "gpu_hot",
                    f"GPU temperature {temp:.0f} C >= {self.temp_alert_c:g} C "
                    "(throttling likely; check cooling or lower the load)",
                    value=temp,
                    threshold=self.temp_alert_c,
                    severity="warning",
                )
            ]
        return []

    def _open(self) -> str | None:
        """Open the NVML handle; returns why it is off, or None."""
        if not torch.cuda.is_available():
            return "no CUDA device"
        if not is_nvml_available():
            return 'pynvml is not installed (pip install "hf-stable[nvml]")'
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except pynvml.NVMLError:
                handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self._nvml, self._handle = pynvml, handle
        except Exception as e:  # noqa: BLE001 - a broken driver must not stop training
            return f"NVML failed to initialise ({e})"
        return None

    def read(self) -> dict[str, float]:
        nv, h = self._nvml, self._handle
        out = dict.fromkeys(_KEYS, float("nan"))
        for key, fn in (
            ("hw/gpu_temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            ("hw/sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            ("hw/power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("hw/gpu_util_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
        ):
            with contextlib.suppress(Exception):  # some counters are unsupported on some boards
                out[key] = float(fn())
        return out

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if not self.enabled:
            return
        self._device = collective_device(args)
        self._off_reason = self._open() if self._handle is None else None
        if all_reduce_flag(self._off_reason is not None) and self._off_reason is None:
            self._off_reason = "NVML is not available on every rank"
        if self._off_reason:
            logger.info("hardware monitor is off: %s", self._off_reason)

    def on_step_end(self, args, state, control, **kwargs):
        if self.enabled and self._off_reason is None and self._handle is not None and control.should_log:
            reading = self.read()
            values = reduce_host([reading[k] for k in _KEYS], "max", self._device)
            self.observe(state.global_step, dict(zip(_KEYS, values, strict=False)))
        super().on_step_end(args, state, control, **kwargs)
