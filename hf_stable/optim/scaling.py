"""LR compensation when the effective batch changes (batch-size warmup, thermal guard).

Linear scaling keeps the per-sample step size of SGD; the square-root rule keeps the update noise of Adam-type
optimizers roughly constant. Both are heuristics, not laws: the guards use them to keep a batch change from
also being a silent LR change.
"""

from __future__ import annotations

import math

from hf_stable.errors import ConfigError


def rescale_lr(lr: float, old_batch: float, new_batch: float, rule: str = "sqrt") -> float:
    """Return the LR for `new_batch` given `lr` at `old_batch`: `lr * (new/old)` (linear) or `lr * sqrt(new/old)`.

    Raises:
        ConfigError: a batch size <= 0 or an unknown rule.

    Example:
        >>> rescale_lr(1e-4, 8, 32, "sqrt")
        0.0002
    """
    problems = []
    if not old_batch > 0 or not new_batch > 0:
        problems.append(f"batch size: got old={old_batch}, new={new_batch}, both must be > 0")
    if rule not in ("sqrt", "linear"):
        problems.append(f"rule: got {rule!r}, allowed: 'sqrt', 'linear'")
    if problems:
        raise ConfigError(problems)
    ratio = new_batch / old_batch
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))
