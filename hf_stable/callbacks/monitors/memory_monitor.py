"""`MemoryMonitor`: CUDA allocated / reserved / peak / fragmentation / alloc retries / OOMs, process RSS, leaks.

Everything here is host-side bookkeeping (`torch.cuda.memory_stats` reads counters, no device sync), sampled
in `on_step_end` at logging steps and every `every_n_steps` steps. `peak` is the peak since the previous
sample (the counter is reset after each read). Values are max-reduced over ranks so every rank logs and decides
on the same numbers (the worst rank is the one that will OOM).

Leak rule: over the last `leak_window` samples (after `warmup_steps`), the tracked quantity (CUDA reserved, or
RSS on CPU) rose in at least `leak_rising_fraction` of the sample-to-sample changes and by at least
`leak_min_growth_gib` in total. One flat or falling sample is tolerated; a sawtooth is not a leak.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections import deque

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.config.stability import MemoryMonitorConfig
from hf_stable.core.monitor_utils import AlertGate, collective_device, reduce_host

GIB = float(1 << 30)
_KEYS = ("allocated", "reserved", "peak", "retries", "ooms", "rss")


_PROCESS: list = [None, None]  # (pid, psutil.Process): made once per process (creating one reads /proc/<pid>/stat)


def _rss_bytes() -> int:
    import psutil

    pid = os.getpid()  # (a forked worker gets its own)
    if _PROCESS[0] != pid:
        _PROCESS[:] = [pid, psutil.Process(pid)]
    return _PROCESS[1].memory_info().rss


def sample_memory(device: torch.device | None = None) -> dict[str, float]:
    """One memory sample: CUDA counters when CUDA is in use (GiB / counts), and the process RSS (GiB)."""
    out = {k: float("nan") for k in _KEYS}
    with contextlib.suppress(Exception):  # psutil is a core dependency, but never crash a run over a metric
        out["rss"] = _rss_bytes() / GIB
    if torch.cuda.is_available() and torch.cuda.is_initialized() and (device is None or device.type == "cuda"):
        stats = torch.cuda.memory_stats(device)
        out["allocated"] = stats.get("allocated_bytes.all.current", 0) / GIB
        out["reserved"] = stats.get("reserved_bytes.all.current", 0) / GIB
        out["peak"] = stats.get("allocated_bytes.all.peak", 0) / GIB
        out["retries"] = float(stats.get("num_alloc_retries", 0))
        out["ooms"] = float(stats.get("num_ooms", 0))
        torch.cuda.reset_peak_memory_stats(device)
    return out


class MemoryMonitor(StabilityCallback):
    """Logs `mem/allocated_gib`, `mem/reserved_gib`, `mem/peak_gib`, `mem/fragmentation`, `mem/alloc_retries`,
    `mem/ooms` (CUDA) and `mem/rss_gib`; events `memory_leak`, `alloc_retries`, `oom`.

    Args:
        config: a `MemoryMonitorConfig` (default `MemoryMonitorConfig()`; every field is documented there and in
            docs/CONFIG.md).
        **overrides: `MemoryMonitorConfig` fields to change, e.g. `MemoryMonitor(leak_window=20)`.

    Example:
        >>> MemoryMonitor(every_n_steps=50, leak_window=20)
    """

    def __init__(self, config: MemoryMonitorConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(MemoryMonitorConfig, config, overrides)
        self._gate = AlertGate(cfg.cooldown_steps)
        self._trend: deque[float] = deque(maxlen=cfg.leak_window)
        self._retries = 0.0
        self._ooms = 0.0
        self._device = torch.device("cpu")

    def state_dict(self) -> dict:
        return {
            "trend": list(self._trend),
            "retries": self._retries,
            "ooms": self._ooms,
            "gate": self._gate.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._trend = deque((float(x) for x in state.get("trend", [])), maxlen=self.leak_window)
        self._retries = float(state.get("retries", 0.0))
        self._ooms = float(state.get("ooms", 0.0))
        self._gate.load_state_dict(state.get("gate", {}))

    # --- decisions (pure) -------------------------------------------------------------------------
    def observe(self, step: int, sample: dict[str, float]) -> list[dict]:
        """Record metrics of one sample and judge the leak trend and allocator distress."""
        cuda = sample.get("reserved") == sample.get("reserved")  # not NaN
        metrics = {}
        if cuda:
            reserved, allocated = sample["reserved"], sample["allocated"]
            metrics.update(
                {
                    "mem/allocated_gib": allocated,
                    "mem/reserved_gib": reserved,
                    "mem/peak_gib": sample["peak"],
                    "mem/alloc_retries": sample["retries"],
                    "mem/ooms": sample["ooms"],
                }
            )
            metrics["mem/fragmentation"] = (reserved - allocated) / reserved if reserved > 0 else 0.0
        if sample.get("rss") == sample.get("rss"):
            metrics["mem/rss_gib"] = sample["rss"]
        self.record(metrics)
        events = []
        if cuda and sample["retries"] > self._retries:
            events += self._alert(
                step,
                "alloc_retries",
                sample["retries"],
                self._retries,
                "warning",
                f"the CUDA caching allocator had to free and retry "
                f"{sample['retries'] - self._retries:.0f} more time(s) (memory pressure: "
                "fragmentation or a batch near the limit)",
            )
        if cuda and sample["ooms"] > self._ooms:
            events += self._alert(
                step,
                "oom",
                sample["ooms"],
                self._ooms,
                "error",
                f"{sample['ooms'] - self._ooms:.0f} CUDA out-of-memory error(s) were raised",
            )
        if cuda:
            self._retries, self._ooms = sample["retries"], sample["ooms"]
        tracked = sample["reserved"] if cuda else sample.get("rss", float("nan"))
        if step < self.warmup_steps or math.isnan(tracked):
            return events
        self._trend.append(tracked)
        if len(self._trend) == self.leak_window:
            values = list(self._trend)
            diffs = [b - a for a, b in itertools.pairwise(values)]
            rising = sum(d > 0 for d in diffs) / len(diffs)
            growth = values[-1] - values[0]
            if rising >= self.leak_rising_fraction and growth >= self.leak_min_growth_gib:
                what = "CUDA reserved" if cuda else "process RSS"
                events += self._alert(
                    step,
                    "memory_leak",
                    growth,
                    self.leak_min_growth_gib,
                    "warning",
                    f"{what} kept rising: +{growth:.3g} GiB over the last {len(values)} samples "
                    f"({rising:.0%} of changes up); tensors kept alive across steps?",
                )
        return events

    def _alert(self, step, kind, value, threshold, severity, message) -> list[dict]:
        suppressed = self._gate.allow(step, kind)
        if suppressed is None:
            return []
        return [self.event(step, kind, message, value=value, threshold=threshold, severity=severity)]

    # --- Trainer hooks ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._device = collective_device(args)

    def on_step_end(self, args, state, control, **kwargs):
        if self.enabled and (control.should_log or state.global_step % self.every_n_steps == 0):
            sample = sample_memory(self._device)
            values = reduce_host([sample[k] for k in _KEYS], "max", self._device)
            self.observe(state.global_step, dict(zip(_KEYS, values, strict=False)))
        super().on_step_end(args, state, control, **kwargs)
