"""Before a rollback: are the *weights* damaged, or is the *data* bad? A counterfactual probe of the step's batch.

K bad steps in a window have two very different causes. Damaged weights (an LR too high, a divergence under way):
the same batch is fine at the snapshot's weights, and restoring them (with a lower LR) is the cure. Bad data (a
run of garbage or corrupted batches, a transient fault): the batch is as bad at the snapshot's weights, or the
fault does not even reproduce; every bad step was skipped, so nothing was damaged, and a rollback would only
throw away the good steps since the snapshot and lower the LR.

The probe re-runs the step's micro-batches (captured by `StepTap`, no copies) twice - at the current weights and
at the snapshot's - with `torch.autograd.grad` (`.grad` untouched), under a forked RNG and the Trainer's
autocast. The re-run at the current
weights calibrates the scale (loss and gradient as the Trainer saw them, whatever its accumulation and rank
averaging), and the snapshot's numbers, on that scale, are judged by the skip guard's own rules with its current
references: would this step have been skipped at the snapshot's weights?

* the real step was non-finite: damaged if the re-run at the current weights is non-finite too and the one at
  the snapshot's is finite; a clean re-run means a transient fault (nothing to undo). One more counterfactual
  separates damaged weights from a batch that overflows at healthy ones (fp16 activations past 65504 on some
  inputs, a borderline batch tipped over by a few steps of normal drift): the last *accepted* step's batch is
  re-run at the current weights (`probe_inputs`). Weights gone bad make every batch non-finite; when that recent
  good batch is still finite, only some inputs overflow - skipping them is the cure, and a rollback plus an LR
  backoff would only repeat with every such batch (in `benchmarks/rescue.py`, fp16 seed 1: four rollbacks to step
  0 and an LR factor of 0.008 where skipping alone ended within 1 % of the clean run);
* the real step was a spike or a rise: damaged if the snapshot does clearly better on the batches (their summed
  loss at the current weights `verify_margin` above the snapshot's, or their gradient norm twice the snapshot's: a
  paired comparison, the batches' own noise cancels) and its numbers pass every skip rule. The batches are the step's and the last `verify_batches` accepted
  steps': at batch 1 one batch is one record, and whether a hard record is a little better at older weights says
  nothing about damage (the former single-batch check confirmed healthy steps as damage in such runs).

Sums are all-reduced, so every rank reaches the same verdict. Cost: two forward/backward passes of one step,
only when a rollback is about to happen; the current trainable weights are copied to CPU meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_stable.compat import foreach_norm
from hf_stable.core.step_tap import StepTap, batch_gradients
from hf_stable.distributed import all_reduce_tensor


@dataclass
class Probe:
    """Gradient L2 norm and summed loss of the step's batch at one set of weights (all ranks summed)."""

    grad_norm: float
    loss: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_norm) and math.isfinite(self.loss)

    def __str__(self) -> str:
        return f"grad norm {self.grad_norm:.4g}, loss {self.loss:.4g}"


def _local_probe(model, params: list[torch.Tensor], tap: StepTap, args, inputs=None) -> torch.Tensor | None:
    """[sum of squared gradient norms, summed loss] on this rank, or None when the batch cannot be re-run."""
    grads: list[torch.Tensor] | None = None
    loss_sum = None
    with tap.replaying():
        for call_args, call_kwargs in tap.inputs if inputs is None else inputs:
            loss, step_grads = batch_gradients(model, params, call_args, call_kwargs, args)
            if loss is None:
                return None
            grads = step_grads if grads is None else [a + b for a, b in zip(grads, step_grads, strict=False)]
            loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    if grads is None:
        return None
    norms = torch.stack([n.to(loss_sum.device) for n in foreach_norm(grads, 2.0)])
    return torch.stack([norms.square().sum(), loss_sum.reshape(())])


def probe_snapshot(
    model, params: list[torch.Tensor], saved: list[torch.Tensor], args=None, extra: list | None = None
) -> tuple[Probe, Probe] | None:
    """(probe at the current weights, probe at `saved`) of the step's micro-batches and `extra` ones (e.g. recent
    accepted steps'), the live weights unchanged afterwards; None when the step cannot be re-run on some rank (no
    captured batch, no loss, an error) - then nobody trusts a verdict."""
    tap = StepTap.shared(model)
    inputs = [*tap.inputs, *(extra or [])]
    device = params[0].device if params else torch.device("cpu")
    results: list[torch.Tensor] = []
    ok = bool(tap.attached and tap.inputs)
    if ok:
        current = [p.detach().to("cpu", copy=True) for p in params]
        try:
            for weights in (None, saved):
                if weights is not None:
                    with torch.no_grad():
                        for p, w in zip(params, weights, strict=False):
                            p.copy_(w)
                local = _local_probe(model, params, tap, args, inputs=inputs)
                if local is None:
                    ok = False
                    break
                results.append(local.to(device))
        except Exception:  # noqa: BLE001 - e.g. out of memory: fall back to rolling back, as without the check; never
            ok = False  # skip the all-reduce below, which the other ranks have entered
        finally:
            with torch.no_grad():
                for p, w in zip(params, current, strict=False):
                    p.copy_(w)
    packed = torch.zeros(5, dtype=torch.float32, device=device)
    if ok:
        packed[:4] = torch.cat(results)
    packed[4] = float(not ok)
    values = all_reduce_tensor(packed, "sum").tolist()
    if values[4]:
        return None
    return Probe(math.sqrt(values[0]), values[1]), Probe(math.sqrt(values[2]), values[3])


def probe_inputs(model, params: list[torch.Tensor], inputs, args=None) -> Probe | None:
    """The probe of other captured micro-batches (`inputs`, e.g. the last accepted step's) at the current weights,
    all ranks summed; None when some rank cannot re-run them. Every rank must call it (it all-reduces)."""
    tap = StepTap.shared(model)
    device = params[0].device if params else torch.device("cpu")
    local = None
    if tap.attached and inputs:
        try:
            local = _local_probe(model, params, tap, args, inputs=inputs)
        except Exception:  # noqa: BLE001 - never skip the all-reduce below, which the other ranks have entered
            local = None
    packed = torch.zeros(3, dtype=torch.float32, device=device)
    if local is not None:
        packed[:2] = local.to(device)
    packed[2] = float(local is None)
    values = all_reduce_tensor(packed, "sum").tolist()
    return None if values[2] else Probe(math.sqrt(values[0]), values[1])


def weights_damaged(
    real_norm: float,
    real_loss: float,
    now: Probe,
    snap: Probe,
    judge,
    recent: Probe | None = None,
    margin: float = 0.0,
) -> bool | None:
    """The verdict for a step the skip guard judged bad with (`real_norm`, `real_loss`): True = the weights are
    damaged (roll back), False = the data is (skip only), None = cannot tell (roll back, as without the check).
    `judge(grad_norm, loss)` returns the skip guard's flags for a step with those numbers (no state change).
    `recent`: the last accepted step's batch re-run at the current weights, when known: finite there, a batch that
    is non-finite now is one the healthy weights overflow on, not a sign of damage. `margin`: for a finite step,
    damage also needs the probed batches' summed loss at the current weights at least this fraction above the
    snapshot's, or their gradient norm twice the snapshot's - a paired comparison (same batches, two sets of
    weights), so one hard batch's own noise cancels. A loss that is not positive (a signed objective) is not compared.
    """
    if not now.finite:  # the batch reproduces a non-finite result at the current weights
        if snap.finite and recent is not None and recent.finite:
            return False
        return snap.finite
    if not (math.isfinite(real_norm) and math.isfinite(real_loss)):
        return False  # non-finite in the step, finite on the re-run: a transient fault, nothing to undo
    if not snap.finite:
        return False
    if now.grad_norm <= 0:
        return None
    # a loss that is not positive on both sides (a signed objective, e.g. GRPO's ~0 policy loss) has no ratio to
    # compare: the gradient norms alone decide
    positive = now.loss > 0 and snap.loss > 0
    better_loss = positive and now.loss >= (1.0 + margin) * snap.loss
    if not better_loss and now.grad_norm < 2.0 * snap.grad_norm:
        return False  # the snapshot does not do clearly better on these batches: nothing to undo
    grad_norm = snap.grad_norm * real_norm / now.grad_norm  # on the scale the Trainer (and the skip guard) saw
    loss = snap.loss * real_loss / now.loss if positive else real_loss
    return not any(judge(grad_norm, loss))
