"""Memory at micro-batch b and 2b: is activation memory linear in the batch, and how large a batch fits?

On a GPU the CUDA caching allocator's peak counter measures one forward/backward exactly; the difference
between 2b and b is the per-sample cost, which extrapolates to the largest micro-batch that fits. On CPU there
is no per-step peak counter, so the probe reports the process RSS and its high-water mark instead (coarse: the
CPU allocator keeps freed pages), which is still enough to spot a batch that would swap.
"""

from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass

import torch

MIB = 1024**2


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass
class MemoryProbe:
    """Memory of one forward/backward at micro-batch `b` and `2b`.

    Args:
        device: "cuda" or "cpu".
        micro_batch: b.
        base_mib: allocated (GPU) or RSS (CPU) before the probe: weights, optimizer state.
        peak_b_mib / peak_2b_mib: peak allocated (GPU) or RSS high-water mark (CPU) during each pass.
        linear: activation memory at 2b within tolerance of twice b's (GPU only; None on CPU).
        max_micro_batch: estimated largest micro-batch that fits (GPU only).
        oom_at: the batch that ran out of memory, if any.
    """

    device: str
    micro_batch: int
    base_mib: float
    peak_b_mib: float | None = None
    peak_2b_mib: float | None = None
    rss_growth_mib: float | None = None
    linear: bool | None = None
    ratio: float | None = None
    max_micro_batch: int | None = None
    total_mib: float | None = None
    oom_at: int | None = None


def _pass(model, batch, autocast) -> None:
    with autocast():
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def probe_memory(model, make_batch, b: int, device, autocast, *, tolerance: float, headroom: float) -> MemoryProbe:
    """Run one forward/backward at b and at 2b (gradients dropped after each) and measure memory.

    Args:
        model: the model in train mode, on `device`.
        make_batch: `make_batch(n)` returns a collated batch of n samples, already on `device`.
        autocast: a context-manager factory matching the run's precision.
        tolerance: `memory_linear_tolerance`; headroom: `memory_headroom` (GPU fraction usable).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        probe = MemoryProbe("cuda", b, base / MIB, total_mib=total / MIB)
        peaks = []
        for n in (b, 2 * b):
            torch.cuda.reset_peak_memory_stats(device)
            try:
                _pass(model, make_batch(n), autocast)
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                probe.oom_at = n
                break
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device))
        if peaks:
            probe.peak_b_mib = peaks[0] / MIB
        if len(peaks) == 2:
            probe.peak_2b_mib = peaks[1] / MIB
            act_b, act_2b = max(peaks[0] - base, 1), max(peaks[1] - base, 1)
            probe.ratio = act_2b / act_b
            probe.linear = abs(probe.ratio - 2.0) <= 2.0 * tolerance
            per_sample = max((act_2b - act_b) / b, 1)
            fixed = max(act_b - per_sample * b, 0)
            probe.max_micro_batch = max(math.floor((total * headroom - base - fixed) / per_sample), 0)
        return probe

    base_rss = rss_bytes()
    probe = MemoryProbe("cpu", b, base_rss / MIB)
    _pass(model, make_batch(b), autocast)
    probe.peak_b_mib = peak_rss_bytes() / MIB
    _pass(model, make_batch(2 * b), autocast)
    probe.peak_2b_mib = peak_rss_bytes() / MIB
    probe.rss_growth_mib = (rss_bytes() - base_rss) / MIB
    return probe
