"""`CompileMonitor`: what torch.compile did during training, in the logs, and a warning when it keeps recompiling.

With ``training.torch_compile: true`` every new input shape (or any other guard dynamo installed, e.g. on a Python
value a hook reads) can make dynamo compile the forward again; after ``torch._dynamo.config.recompile_limit`` (8)
compilations of one function the rest of the run executes it *eagerly*, silently slower. The monitor logs the
process's counts (`hf_stable.compat.dynamo_compile_counts`) at every log line and warns, once per logging interval,
when compilations still happen after the warm-up (`warmup_steps`), naming the step and how to see why
(``TORCH_LOGS=recompiles``) and the knob that bounds them (``data.shape_buckets``). Off when training is not
compiled. Host-only: no device sync, no collective (counts are this process's).
"""

from __future__ import annotations

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.compat import dynamo_compile_counts


class CompileMonitor(StabilityCallback):
    """Logs `compile/compiles`, `compile/recompiles`, `compile/graph_breaks`, `compile/frames_at_limit`; event
    `recompile` (warning) when compilations continue after `warmup_steps`.

    Args:
        warmup_steps: steps during which compilations are expected (the first shapes, the monitors' sampled steps).

    Example:
        >>> trainer = Trainer(..., args=TrainingArguments(torch_compile=True), callbacks=[CompileMonitor()])
    """

    def __init__(self, warmup_steps: int = 20):
        super().__init__()
        self.warmup_steps = warmup_steps
        self._seen = 0  # compiles counted at the last check
        self._warned_at = -1

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.enabled = self.enabled and bool(getattr(args, "torch_compile", False))
        self._seen = dynamo_compile_counts()["compiles"]

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if not self.enabled:
            return
        counts = dynamo_compile_counts()
        self.record({f"compile/{k}": float(v) for k, v in counts.items()})
        new, self._seen = counts["compiles"] - self._seen, counts["compiles"]
        interval = max(1, int(args.logging_steps or 1))
        if new > 0 and state.global_step > self.warmup_steps and state.global_step // interval != self._warned_at:
            self._warned_at = state.global_step // interval
            self.event(
                state.global_step,
                "recompile",
                f"torch.compile compiled {new} more graph(s) at step {state.global_step}, after the warm-up "
                f"({counts['recompiles']} recompilations, {counts['frames_at_limit']} function(s) at dynamo's "
                "recompile limit and now running eagerly): run with TORCH_LOGS=recompiles to see which guard failed; "
                "new input lengths are bounded by data.shape_buckets",
                severity="warning",
                value=float(counts["recompiles"]),
            )
