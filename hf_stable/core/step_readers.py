"""`StepReaders`: monitors read the step's gradient report where the skip guard reads it - one collective a step.

The skip guard's verdict must be the same on every rank and must judge the gradients the optimizer applies. When a
monitor listed before it has already gathered the step's statistics, a gradient edited on one rank between the two
reads (a user's callback, a fault) changes that rank's report only, so the guard has to max-reduce its flags: a
second collective every step. Instead, while a decider (the skip guard) will read the step later in the same hook,
a monitor registers its read here (`defer`); the decider's `GradStats.compute` gathers once - after every edit
listed before it, with the max |g| a deferred reader asked for - and the decider runs the deferred reads right after
(`flush`), before its verdict. A decider whose own call gathered the rows needs no second collective: every rank's
report came out of that gather (`GradStats.row_gathers` tells, the same on every rank).

Rank agreement: whether a read is deferred depends only on configuration (the decider's presence, `enabled`, its
off state), whether it runs distributed, and the step label - never on this rank's gradients. A deferred read that
the decider did not run (it turned itself off) runs at the monitors' `on_optimizer_step` (`flush`), where every rank
calls it. One process: nothing is deferred (there is no collective to save).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from hf_stable.distributed import is_distributed


class StepReaders:
    """Deferred reads of one model's `GradStats` report (one instance per `GradStats`: `stats.readers`).

    Example:
        >>> if not stats.readers.defer(state.global_step, lambda: self._read(...), max_abs=log_step):
        ...     self._read(...)                               # no decider later in this hook: read now
        >>> stats.readers.flush(state.global_step)            # the decider, after its read (and on_optimizer_step)
    """

    def __init__(self):
        self._decider = None  # weak reference to an object with `judges_later(step) -> bool`
        self._pending: list[tuple[int, Callable[[], None]]] = []
        self._max_abs_step: int | None = None

    def set_decider(self, decider) -> None:
        """`decider.judges_later(step)` says whether it will gather step `step`'s report later in the current hook
        (the skip guard, from `on_train_begin`); None removes it (`on_train_end`)."""
        self._decider = None if decider is None else weakref.ref(decider)
        self._pending.clear()
        self._max_abs_step = None

    def decider_pending(self, step: int) -> bool:
        decider = self._decider() if self._decider is not None else None
        return decider is not None and is_distributed() and decider.judges_later(step)

    def defer(self, step: int, read: Callable[[], None], max_abs: bool = False) -> bool:
        """Run `read()` right after the decider reads step `step`'s report (True), or not at all here (False: the
        caller reads now). `max_abs`: the exact max |g| goes into the decider's gather."""
        if not self.decider_pending(step):
            return False
        self._pending = [(s, fn) for s, fn in self._pending if s == step]
        self._pending.append((step, read))
        if max_abs:
            self._max_abs_step = step
        return True

    def wants_max_abs(self, step) -> bool:
        return step is not None and self._max_abs_step == step

    def flush(self, step) -> None:
        """Run step `step`'s deferred reads, in the order they were registered (every rank calls it at the same
        point; a read may compute the report - a collective only where every rank's read does)."""
        due = [fn for s, fn in self._pending if s == step]
        self._pending = [(s, fn) for s, fn in self._pending if s != step]
        for fn in due:
            fn()


__all__ = ["StepReaders"]
