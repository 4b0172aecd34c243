"""`BatchWarmupGuard`: start with a small effective batch and double it every N steps up to the target.

The accumulation is applied by `AccumulationControl` (see there for why changing the Trainer's gradient
accumulation between steps keeps the per-token loss normalisation exact, and for the alignment rule); the LR is
compensated there too (sqrt or linear in the batch ratio), on top of the schedule. Stateless: the stage is a
function of `global_step`, so a resumed run continues at the right stage.
"""

from __future__ import annotations

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.accumulation_control import AccumulationControl
from hf_stable.config.guards import BatchWarmupConfig


class BatchWarmupGuard(StabilityCallback):
    """Requests `initial x 2^(step // double_every)` micro-batches per step (capped at the target).

    Args:
        accumulation: the `AccumulationControl` (listed after this guard).
        config: a `BatchWarmupConfig` (default `BatchWarmupConfig()` switched on; every field is documented there
            and in docs/CONFIG.md; `target_accumulation` and `lr_rule` are the `AccumulationControl`'s business).
        **overrides: `BatchWarmupConfig` fields to change, e.g. `BatchWarmupGuard(acc, double_every=100)`.

    Example:
        >>> lr = LRControl(); acc = AccumulationControl(lr, target=16)
        >>> callbacks = [BatchWarmupGuard(acc, initial_accumulation=1, double_every=100), acc, lr]
    """

    def __init__(self, accumulation: AccumulationControl, config: BatchWarmupConfig | None = None, **overrides):
        super().__init__()
        self._use_config(BatchWarmupConfig, config, overrides)
        self.accumulation = accumulation
        accumulation.add_plan("batch_warmup", self._plan)

    def _plan(self, step: int) -> float:
        return self.accumulation_at(step) / self.accumulation.target if self.enabled else 1.0

    def accumulation_at(self, step: int) -> int:
        """The accumulation wanted for optimizer steps after `step` completed steps."""
        return min(self.accumulation.target, self.initial_accumulation * 2 ** (step // self.double_every))

    def _request(self, step: int) -> None:
        self.accumulation.request("batch_warmup", self.accumulation_at(step) / self.accumulation.target)

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.enabled:
            self._request(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.enabled:
            self._request(state.global_step)
        super().on_step_end(args, state, control, **kwargs)
