"""`ReplicaCheck`: the data-parallel replicas of the weights must stay identical; a run whose ranks diverged stops.

Under DDP and DeepSpeed ZeRO-1/2 every rank holds the whole model weights and applies the same all-reduced update, so
the replicas stay bitwise identical unless something broke that silently: a rank-local write to the weights (a
callback, a hook, a bad restore), a non-deterministic kernel in a rank's own update, a flipped bit. Each rank then
trains its own model and the saved adapter (rank 0's) is not the one the other ranks' gradients were computed for.
Megatron-LM checks a hash of the weights across data-parallel replicas at an interval for the same reason.

The rule: at train start (and on resume) and every `interval` optimizer steps, each rank reduces every trainable
weight to a checksum - the sum, modulo 2**64, of its raw bit patterns read as integers: exact and independent of
the summation order, so identical weights give identical sums on any device and a changed bit changes it - next to
its L2 norm (for the message only). One all-gather of that small vector follows; every rank compares all ranks' rows
and so reaches the same verdict. A mismatch writes one `replica_mismatch` event naming the ranks and the first
differing parameter and raises `ReplicaMismatchError` on every rank: the recipe prints one message, marks the run
failed in RUN_INCOMPLETE.json and exits 1. Where weights are sharded (FSDP2, ZeRO-3; `StepEngine.replicated_weights`)
there is nothing to compare: one `monitor_off` event says so. One process: nothing to compare, no collective.
Cost: one read of the trainable weights per check (benchmarks/replica_check.py).
"""

from __future__ import annotations

import time

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.compat import foreach_norm
from hf_stable.config.stability import ReplicaCheckConfig
from hf_stable.core.engine import StepEngine
from hf_stable.distributed import all_gather_tensor, is_distributed
from hf_stable.errors import HfStableError

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatchError(HfStableError):
    """The ranks' replicas of the weights differ: the run cannot be trusted (raised on every rank alike)."""

    exit_code = 1
    reason = "replica mismatch"


def weight_checksums(params: list[torch.Tensor]) -> torch.Tensor:
    """`[2 * n]` int64 on the weights' device: each tensor's bit-pattern sum (mod 2**64), then its float64 L2 norm's
    bits. The bit sums decide (exact, order-free); the norms only describe a mismatch."""
    if not params:
        return torch.zeros(0, dtype=torch.int64)
    with torch.no_grad():
        bits = [p.detach().view(_BITS[p.element_size()]).sum(dtype=torch.int64) for p in params]
        return torch.cat([torch.stack(bits), _norms(params).view(torch.int64)])


def _norms(params: list[torch.Tensor]) -> torch.Tensor:
    """float64 L2 norm of each tensor, accumulated in float32 (float64 for float64 tensors): one foreach call each."""
    out = torch.empty(len(params), dtype=torch.float64, device=params[0].device)
    for wide in (False, True):
        idx = [i for i, p in enumerate(params) if (p.dtype == torch.float64) == wide]
        if idx:
            dtype = torch.float64 if wide else torch.float32
            norms = foreach_norm([params[i].detach() for i in idx], 2.0, dtype=dtype)
            out[idx] = torch.stack(norms).to(torch.float64)
    return out


def compare_replicas(gathered: torch.Tensor, names: list[str]) -> dict | None:
    """The verdict on every rank's checksums (`[world, 2 * n]`, from `weight_checksums`): None when all ranks agree,
    else {"parameter", "index", "n_differing", "ranks" (those that differ from rank 0), "norms" (per rank)}."""
    n = len(names)
    bits = gathered[:, :n]
    differ = (bits != bits[:1]).any(dim=0)  # [n]: some rank's sum differs from rank 0's
    if not bool(differ.any()):
        return None
    index = int(differ.nonzero()[0])
    ranks = [r for r in range(gathered.shape[0]) if bool((bits[r] != bits[0]).any())]
    norms = gathered[:, n + index].contiguous().view(torch.float64).tolist()
    return {
        "parameter": names[index],
        "index": index,
        "n_differing": int(differ.sum()),
        "ranks": ranks,
        "norms": norms,
    }


class ReplicaCheck(StabilityCallback):
    """Stops the run when the data-parallel replicas of the trainable weights disagree.

    No metric is logged (a timing would differ between ranks, and every rank logs the same numbers); `checks` counts
    the checks made and `last_check_ms` is this rank's time for the last one (benchmarks/replica_check.py reads it).

    Args:
        config: a `ReplicaCheckConfig` (default `ReplicaCheckConfig()`; fields documented there and in
            docs/CONFIG.md).
        **overrides: `ReplicaCheckConfig` fields to change, e.g. `ReplicaCheck(interval=10)`.

    Raises:
        ReplicaMismatchError: on every rank, at the first check whose checksums differ between ranks.

    Example:
        >>> trainer = Trainer(..., callbacks=[ReplicaCheck(interval=100)])
    """

    def __init__(self, config: ReplicaCheckConfig | None = None, **overrides):
        super().__init__()
        self._use_config(ReplicaCheckConfig, config, overrides)
        self._params: list[tuple[str, torch.Tensor]] | None = None
        self._active = False
        self._last_agreed: int | None = None
        self.checks = 0
        self.last_check_ms: float | None = None

    def state_dict(self) -> dict:
        return {"last_agreed": self._last_agreed, "checks": self.checks}

    def load_state_dict(self, state: dict) -> None:
        self._last_agreed = state.get("last_agreed")
        self.checks = int(state.get("checks", 0))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        self._params = None
        # rank-agreed: the configuration, the process group's size and the engine (the same on every rank)
        self._active = bool(self.enabled and model is not None and is_distributed())
        if not self._active:
            return
        engine = StepEngine.of(model)
        if not engine.replicated_weights:
            self._active = False
            self.event(
                state.global_step,
                "monitor_off",
                f"replica check off: under {engine.describe()} each rank holds its own shard of the weights, so "
                "there are no replicas to compare",
                severity="info",
            )
            return
        self.check(model, state.global_step)  # at train start, and on resume after the checkpoint is loaded

    def on_step_end(self, args, state, control, model=None, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if self._active and model is not None and state.global_step % self.interval == 0:
            self.check(model, state.global_step)

    def check(self, model, step: int) -> None:
        """Compare this rank's checksums with every other rank's (a collective: every rank calls it at `step`).

        Raises:
            ReplicaMismatchError: some rank's trainable weights differ from rank 0's.
        """
        if self._params is None:
            self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        names = [n for n, _ in self._params]
        started = time.perf_counter()
        local = weight_checksums([p for _, p in self._params])
        gathered = all_gather_tensor(local).cpu()  # one collective and one host transfer per check
        verdict = compare_replicas(gathered, names)
        self.last_check_ms = (time.perf_counter() - started) * 1e3
        self.checks += 1
        if verdict is None:
            self._last_agreed = step
            return
        self._stop(step, verdict)

    def _stop(self, step: int, v: dict) -> None:
        others = ", ".join(str(r) for r in v["ranks"])
        norms = ", ".join(f"rank {r}: {x:.9g}" for r, x in enumerate(v["norms"]))
        more = f" (and {v['n_differing'] - 1} more)" if v["n_differing"] > 1 else ""
        since = (
            f"they last agreed at step {self._last_agreed}: resume from a checkpoint saved at or before it"
            if self._last_agreed is not None
            else "they never agreed in this run: start it again"
        )
        message = (
            f"replica mismatch at step {step}: the weights of rank {others} differ from rank 0's, first at parameter "
            f"{v['parameter']}{more} (L2 norms {norms}); the ranks no longer train the same model and this run "
            f"cannot be trusted: {since}"
        )
        self.event(
            step,
            "replica_mismatch",
            message,
            severity="error",
            ranks=[0, *v["ranks"]],
            parameter=v["parameter"],
            n_differing=v["n_differing"],
            norms=v["norms"],
            last_agreed_step=self._last_agreed,
        )
        raise ReplicaMismatchError(message)


__all__ = ["ReplicaCheck", "ReplicaMismatchError", "compare_replicas", "weight_checksums"]
