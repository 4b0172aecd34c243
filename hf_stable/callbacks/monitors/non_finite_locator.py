"""`NonFiniteLocator`: on a NaN/Inf gradient or loss, name the parameters (and optionally the op) and the step.

Where the gradients can be read matters. By `on_pre_optimizer_step` the Trainer has called
`clip_grad_norm_(params, max_norm or inf)`, whose coefficient is NaN as soon as the total norm is non-finite,
so one NaN gradient has turned *every* gradient into NaN (measured on transformers 5.24; see `grad_stats`).
`hf_stable.trainer.StableTrainer` reads the gradients before its clip and never spreads a NaN. A non-finite loss
also makes every gradient non-finite, legitimately. The locator therefore works in two stages:

1. From the shared `GradStats`: if only some tensors are non-finite (no poisoning, e.g. a custom loop), those
   are the culprits — no extra work.
2. If every gradient is non-finite, it re-runs the step's micro-batches (captured by `StepTap`, no copies) on
   the unwrapped model with `torch.autograd.grad`, which leaves `.grad` untouched, under a forked RNG so the
   run's randomness is unchanged, and names the parameters whose fresh gradients are non-finite. With
   `detect_anomaly=True` the re-run also names the backward op that produced the first NaN. The re-run costs one
   forward/backward of the step, only on a failing step, at most `max_reruns` times per run. When the re-run gives
   finite gradients the event says the fault did not reproduce (transient), instead of naming every tensor.

Ranks: a fault can hit one rank only (a NaN written after DDP's all-reduce, a NaN loss in one rank's batch), and
cooldowns then drift apart if fed local numbers. So every branch reads rank-agreed values: the `GradStats` report
(the same on every rank), one max-reduce of the per-tensor flags on each failing step (unconditional then, and
which also decides the re-run: only when every rank wants it), and one inside the re-run.
"""

from __future__ import annotations

import math
import re
import warnings

import torch

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.compat import foreach_norm
from hf_stable.config.stability import NonFiniteConfig
from hf_stable.core.grad_stats import GradStats
from hf_stable.core.monitor_utils import AlertGate
from hf_stable.core.step_tap import StepTap, StepTapUser, batch_gradients
from hf_stable.distributed import all_reduce_tensor
from hf_stable.logging import get_logger
from hf_stable.optim.roles import classify

logger = get_logger(__name__)
_OP_RE = re.compile(r"Function '(\w+)' returned nan")


class NonFiniteLocator(StepTapUser, StabilityCallback):
    """Names the parameters whose gradients are NaN/Inf (event `nonfinite_grad`) and flags a non-finite step
    loss (event `nonfinite_loss`).

    Args:
        config: a `NonFiniteConfig` (default `NonFiniteConfig()`; every field is documented there and in
            docs/CONFIG.md).
        **overrides: `NonFiniteConfig` fields to change, e.g. `NonFiniteLocator(detect_anomaly=True)`.

    Example:
        >>> trainer = Trainer(..., callbacks=[NonFiniteLocator(detect_anomaly=True)])
    """

    def __init__(self, config: NonFiniteConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(NonFiniteConfig, config, overrides)
        self._gate = AlertGate(cfg.cooldown_steps)
        self._reruns = 0
        self._nonfinite_steps: list[int] = []
        self._off = False
        self.last_located: dict | None = None

    def state_dict(self) -> dict:
        return {
            "reruns": self._reruns,
            "nonfinite_steps": self._nonfinite_steps[-100:],
            "gate": self._gate.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._reruns = int(state.get("reruns", 0))
        self._nonfinite_steps = [int(s) for s in state.get("nonfinite_steps", [])]
        self._gate.load_state_dict(state.get("gate", {}))

    # --- Trainer hooks ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        self._off = False
        self._use_step_tap(model if self.enabled else None)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.enabled or model is None or self.engine_unhosted(state, model):
            return
        stats = GradStats.shared(model)
        read = lambda: self._read(stats, model, args, state)
        if not stats.readers.defer(state.global_step, read):  # else: at the skip guard's gather (`step_readers`)
            read()

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            GradStats.shared(model).readers.flush(state.global_step)  # a deferred read no gather ran (rank-agreed)

    def _read(self, stats: GradStats, model, args, state) -> None:
        report = stats.compute(model, step=state.global_step)  # rank-agreed numbers (see the module docstring)
        step = state.global_step + 1
        num, den = report.extras.get("loss_num"), report.extras.get("loss_den")
        if den and not math.isfinite(num) and (suppressed := self._gate.allow(step, "nonfinite_loss")) is not None:
            more = f" ({suppressed} later non-finite steps suppressed before this one)" if suppressed else ""
            self.event(
                step,
                "nonfinite_loss",
                f"the training loss of step {step} is {num / den}{more}",
                value=num / den,
                severity="error",
            )
        if self._off or not report.available or report.nonfinite_total == 0:
            return
        self._nonfinite_steps.append(step)
        suppressed = self._gate.allow(step, "nonfinite_grad")  # None on every rank alike: its inputs are agreed
        dev = stats.device_stats(model, step=state.global_step)
        # One max-reduce on every failing step, whatever the cooldown says: which tensors are non-finite on any
        # rank, which weights are, and whether some rank declines a re-run (so nobody enters it alone). The
        # vector runs over every trainable tensor, so its size is the same on every rank.
        named = stats.named_params
        engine = stats.engine
        wants_rerun = (
            dev is not None
            and suppressed is not None
            and self.rerun
            and engine.can_rerun
            and self._reruns < self.max_reruns
        )
        with torch.no_grad():
            weights = torch.stack(foreach_norm([engine.local(p) for _, p in named], 2.0))
            grads = torch.zeros_like(weights)
            if dev is not None:
                at = {name: i for i, (name, _) in enumerate(named)}
                index = torch.tensor([at[name] for name in dev.names], device=weights.device)
                grads[index] = (~torch.isfinite(dev.param_norms.to(weights.device))).float()
            flags = torch.cat([grads, (~torch.isfinite(weights)).float(), weights.new_tensor([not wants_rerun])])
        flags = all_reduce_tensor(flags, "max").tolist()  # second transfer: failing steps only
        n = len(named)
        names = [name for (name, _), bad in zip(named, flags[:n], strict=False) if bad]
        n_bad_weights, rerun = int(sum(flags[n : 2 * n])), not flags[-1]
        if suppressed is None:
            return
        how, op = "gradients", None
        if len(names) == n and n > 1:
            # Every gradient is non-finite: a non-finite loss does that, and so does the stock Trainer's clip
            # (its NaN coefficient); `StableTrainer` does not spread NaN, so there the gradients are the truth.
            cause = (
                "the loss is non-finite"
                if den and not math.isfinite(num)
                else "as found"
                if stats.pre_clip
                else "the Trainer's clip_grad_norm_ spreads one NaN to all"
            )
            why = (
                "switched off"
                if not self.rerun
                else f"is not possible under {engine.describe()}"
                if not engine.can_rerun
                else f"used up (max_reruns={self.max_reruns})"
            )
            located = None
            if rerun:
                located, op, why = self._rerun(model, named, args)
            if located:
                names, how = located, f"a re-run of the step (every gradient was non-finite: {cause})"
            else:
                how = f"gradients - every one is non-finite ({cause}); the re-run {why}"
        self._report(step, names, how, op, suppressed, n_bad_weights)

    # --- locating ---------------------------------------------------------------------------------------
    def _rerun(self, model, named, args) -> tuple[list[str] | None, str | None, str]:
        """Fresh gradients of the step's micro-batches: (non-finite parameters or None, backward op, what the re-run
        found when it names nobody). Every rank reaches the one collective, whatever fails on it."""
        tap = StepTap.shared(model)
        self._reruns += 1
        params = [p for _, p in named]
        # last slot: 1 when this rank could not re-run (no inputs, no loss, an error) - then nobody trusts it
        bad = torch.zeros(len(params) + 1, dtype=torch.float32, device=params[0].device)
        bad[-1] = float(not tap.inputs)
        op = None
        with tap.replaying():
            for call_args, call_kwargs in tap.inputs:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        grads, op_here = self._grads_once(model, params, call_args, call_kwargs, args)
                except Exception as e:  # noqa: BLE001 - a failed re-run (e.g. OOM) must not kill training or skip
                    # the collective below, which the other ranks have entered
                    logger.warning("non-finite locator: re-run failed (%s); naming from gradients only", e)
                    grads, op_here = None, None
                op = op or op_here
                if grads is None:
                    bad[-1] = 1.0
                    break
                norms = torch.stack(foreach_norm(grads, 2.0)).to(bad.device)
                bad[:-1] = torch.maximum(bad[:-1], (~torch.isfinite(norms)).to(torch.float32))
        flags = all_reduce_tensor(bad, "max").tolist()
        if flags[-1]:
            return None, op, "was not possible (no captured batch, no loss, or it failed)"
        names = [n for (n, _), f in zip(named, flags, strict=False) if f]
        if not names:  # the same batch and weights now give finite gradients
            return (
                None,
                op,
                (
                    "gave finite gradients: the fault did not reproduce (transient - e.g. a hardware "
                    "error, a race, a non-deterministic op, or a fault injected into that one step)"
                ),
            )
        return names, op, "named them"

    def _grads_once(self, model, params, call_args, call_kwargs, args):
        """Gradients of one micro-batch (and, under detect_anomaly, the backward op that first made a NaN)."""
        op = None
        if self.detect_anomaly:
            try:
                with torch.autograd.detect_anomaly(check_nan=True):
                    return batch_gradients(model, params, call_args, call_kwargs, args)[1], None
            except RuntimeError as e:
                match = _OP_RE.search(str(e))
                if match is None:
                    raise
                op = match.group(1)  # anomaly mode stopped at the first NaN; run again for every gradient
        return batch_gradients(model, params, call_args, call_kwargs, args)[1], op

    def _report(
        self, step: int, names: list[str], how: str, op: str | None, suppressed: int, n_bad_weights: int
    ) -> None:
        groups: dict[str, int] = {}
        for n in names:
            g = classify(n).group
            groups[g] = groups.get(g, 0) + 1
        listed = ", ".join(names[: self.max_names]) + (
            f" (+{len(names) - self.max_names} more)" if len(names) > self.max_names else ""
        )
        where = f"; first NaN produced by backward op {op}" if op else ""
        if op is None and self.detect_anomaly and "re-run" in how:
            where = "; no backward op produced it (a gradient hook, or NaN already in the inputs or weights)"
        if n_bad_weights:
            where += f"; {n_bad_weights} weight tensor(s) are already non-finite (an earlier update corrupted them)"
        if suppressed:
            where += f" ({suppressed} non-finite steps suppressed since the last event)"
        first_group = next(iter(groups), None)
        self.last_located = {"step": step, "params": names, "groups": groups, "op": op}
        self.event(
            step,
            "nonfinite_grad",
            f"non-finite gradient in {len(names)} tensor(s) at step {step} ({_groups_text(groups)}), found by {how}: "
            f"{listed}{where}",
            group=first_group if len(groups) == 1 else ",".join(groups)[:200],
            value=len(names),
            threshold=0,
            severity="error",
            params=names,
            groups=groups,
            op=op,
            nonfinite_weights=n_bad_weights,
        )


def _groups_text(groups: dict[str, int], limit: int = 4) -> str:
    """e.g. "layer_0.lora_A 7, layer_0.lora_B 7, +2 more groups": where the tensors sit, capped for a console line."""
    items = [f"{g} {n}" for g, n in groups.items()]
    return ", ".join(items[:limit]) + (f", +{len(items) - limit} more groups" if len(items) > limit else "")
