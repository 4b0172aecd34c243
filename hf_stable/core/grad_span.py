"""The step's gradient check for `GradStats`: a fingerprint of the gradients it read, and the span of hf_stable's own
callbacks in which a check, once made, holds.

A fingerprint is every gradient's identity (a weak reference) and version counter: a gradient edited in place or
replaced since, a new run restarting the step count, or `zero_grad(set_to_none=False)` reuse across steps all change
it. Reading one costs two attribute reads per tensor, so inside a span - a run of consecutive hf_stable callbacks
under `StableTrainer`'s dispatch (`callbacks.ordering.skip_noop_hooks`) - a check is made once: any other callback, a
hook patched onto one of ours, or a skip that drops the gradients ends the span, and the next read checks again.
"""

from __future__ import annotations

import operator
import weakref

from hf_stable.compat import tensor_versions

# The span now running: a fresh object each time a run of hf_stable callbacks starts, None outside one (read as
# `SPAN[0]` on the step path).
SPAN: list = [None]


def open_span() -> None:
    """hf_stable's own callbacks run from here (`callbacks.ordering.skip_noop_hooks`): a gradient check made in the span
    holds for the rest of it. Their own gradient edits go through `GradStats.edited` or end the span (a skip)."""
    if SPAN[0] is None:
        SPAN[0] = object()


def close_span() -> None:
    """Other code may run from here (a user's callback, the Trainer, a skip that dropped the gradients): the next read
    checks the gradients again."""
    SPAN[0] = None


def _gone():
    """Stands in for the weak reference of a missing gradient (calling it gives None)."""


def fingerprint(grads: list) -> tuple[list, list[int]]:
    """(weak references, versions) of `grads`."""
    return [_gone if g is None else weakref.ref(g) for g in grads], tensor_versions(grads)


def same_tensors(grads: list, refs: list) -> bool:
    """Every gradient is the object its reference was taken of."""
    return len(refs) == len(grads) and all(map(operator.is_, grads, [r() for r in refs]))


def unchanged(grads: list, seen: tuple[list, list[int]]) -> bool:
    """The gradients are the fingerprinted ones at the same versions, or every one was dropped since (a skip)."""
    refs, vers = seen
    return (tensor_versions(grads) == vers and same_tensors(grads, refs)) or all(g is None for g in grads)
