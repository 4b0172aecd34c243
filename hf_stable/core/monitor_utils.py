"""Small pieces every monitor shares: alert cooldowns, rank reduction of host numbers, environment checks."""

from __future__ import annotations

import torch

from hf_stable.distributed import all_reduce_tensor, world_size


class AlertGate:
    """Rate-limits an alert per (kind, group): after firing, the same key stays quiet for `cooldown_steps`.

    A diverging run would otherwise write one event per step. Suppressed occurrences are counted and reported
    by the next event of that key. The state is JSON-safe (saved on resume with the owning callback).
    """

    def __init__(self, cooldown_steps: int):
        self.cooldown_steps = int(cooldown_steps)
        self._last: dict[str, int] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, step: int, kind: str, group: str | None = None) -> int | None:
        """None when the alert must stay quiet; else how many occurrences were suppressed since it last fired."""
        key = f"{kind}|{group or ''}"
        last = self._last.get(key)
        if last is not None and step - last < self.cooldown_steps:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = step
        return self._suppressed.pop(key, 0)

    def state_dict(self) -> dict:
        return {"last": dict(self._last), "suppressed": dict(self._suppressed)}

    def load_state_dict(self, state: dict) -> None:
        self._last = {k: int(v) for k, v in (state or {}).get("last", {}).items()}
        self._suppressed = {k: int(v) for k, v in (state or {}).get("suppressed", {}).items()}


def reduce_host(values: list[float], op: str, device: torch.device | str = "cpu") -> list[float]:
    """Reduce a few host numbers over ranks (op "sum" or "max") in one collective; unchanged on one process.

    Host measurements (memory, timings) differ per rank; reducing them makes every rank log and decide on the
    same numbers. `device` must suit the backend (CUDA for NCCL).
    """
    if world_size() == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    return all_reduce_tensor(t, "sum" if op == "sum" else "max").tolist()


def collective_device(args) -> torch.device:
    """The device a collective tensor must live on (the Trainer's device: CUDA under NCCL, CPU under gloo)."""
    try:
        return torch.device(args.device)
    except Exception:  # noqa: BLE001 - args without a device (tests): CPU works for gloo
        return torch.device("cpu")


def logs_at(args, step: int) -> bool:
    """Will the Trainer log at `step`? (the decision itself is made later, in DefaultFlowCallback.on_step_end)"""
    if step == 1 and getattr(args, "logging_first_step", False):
        return True
    strategy = getattr(args, "logging_strategy", "steps")
    strategy = str(getattr(strategy, "value", strategy))  # IntervalStrategy enum or plain string
    steps = getattr(args, "logging_steps", 0) or 0
    if "steps" not in strategy or steps <= 0:
        return True  # epoch/no logging: cheap enough to keep the metric exact
    every = steps if steps >= 1 else max(1, int(steps * getattr(args, "max_steps", 1)))
    return step % int(every) == 0


def robust_zscore(value: float, history: list[float]) -> float:
    """(value - median) / (1.4826 * MAD): a z-score that one earlier spike cannot inflate."""
    xs = sorted(history)
    n = len(xs)
    med = xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
    dev = sorted(abs(x - med) for x in xs)
    mad = dev[n // 2] if n % 2 else 0.5 * (dev[n // 2 - 1] + dev[n // 2])
    scale = 1.4826 * mad
    # A perfectly flat history has MAD 0: fall back to a small relative scale so a tiny wobble is not infinite.
    scale = max(scale, 1e-3 * abs(med), 1e-12)
    return (value - med) / scale
