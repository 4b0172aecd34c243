"""`ModelTable`: the per-model registries (`GradStats.shared`, `StepEngine.of`, `StepTap.shared`) with the last lookup
remembered.

A training step asks for the same model's entries some 60 times (every callback hook looks up the shared statistics
and the engine); a `WeakKeyDictionary` lookup makes a weak reference to its key each time. The last (model, entry) pair
is kept by weak reference only, so neither a model nor its entry lives longer than the table would keep it.
"""

from __future__ import annotations

import weakref


class ModelTable(weakref.WeakKeyDictionary):
    """A `WeakKeyDictionary` whose `get` answers a repeat of the last key from a weakly held pair.

    Example:
        >>> table = ModelTable(); table[model] = stats
        >>> table.get(model) is stats
        True
    """

    def __init__(self):
        super().__init__()
        self._last: tuple | None = None  # (weakref to the key, weakref to its value)

    def get(self, key, default=None):
        last = self._last
        if last is not None and last[0]() is key:
            value = last[1]()
            if value is not None:
                return value
        value = super().get(key, default)
        if value is not None and value is not default:
            try:
                self._last = (weakref.ref(key), weakref.ref(value))
            except TypeError:  # a value that takes no weak reference: not remembered
                self._last = None
        return value

    def __setitem__(self, key, value):
        self._last = None
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._last = None
        super().__delitem__(key)

    def pop(self, key, *args):
        self._last = None
        return super().pop(key, *args)

    def popitem(self):
        self._last = None
        return super().popitem()

    def clear(self):
        self._last = None
        super().clear()

    def setdefault(self, key, default=None):
        self._last = None
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        self._last = None
        super().update(*args, **kwargs)


__all__ = ["ModelTable"]
