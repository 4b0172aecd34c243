"""Making every rank take the same decision, and what a guard needs to know about the run's layout."""

from __future__ import annotations

from hf_stable.core.monitor_utils import reduce_host, world_size
from hf_stable.errors import HfStableError


class GuardOrderError(HfStableError):
    """Guards that read another guard's verdict were listed before it in `callbacks=`."""


def agree(flags: list[float], device) -> list[float]:
    """Max-reduce 0/1 flags (or numbers) over ranks, so every rank acts on the same decision.

    Every rank must call this in the same hook at the same step (it is one collective); on one process it
    returns the flags unchanged.
    """
    return reduce_host([float(f) for f in flags], "max", device)


def rank_of(args) -> int:
    return int(getattr(args, "process_index", 0) or 0)


def drop_gradients(optimizer, model=None) -> int:
    """Skip the step for every parameter the optimizer updates (and every trainable one of `model`), the way the
    model's engine skips (`core.engine`): `p.grad = None` under plain/DDP and FSDP2, the engine's own skip under
    DeepSpeed.

    This is what skips a step: AdamW/Lion/SGD leave a parameter without a gradient untouched — no moment update,
    no weight decay. Zeroing the gradient would not skip: momentum and decay still move the weights.
    Returns how many gradients were dropped.
    """
    from hf_stable.core.engine import StepEngine

    seen: set[int] = set()
    params = [p for g in (optimizer.param_groups if optimizer is not None else []) for p in g["params"]]
    if model is not None:
        params += [p for p in model.parameters() if p.requires_grad]
    unique = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    from hf_stable.core.grad_span import close_span

    engine = StepEngine.of(model) if model is not None else StepEngine()
    close_span()  # the gradients change: the next read checks them
    return engine.drop_gradients(unique)


__all__ = ["GuardOrderError", "agree", "drop_gradients", "rank_of", "world_size"]
