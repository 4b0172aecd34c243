"""Reward functions for the GRPO stage, named in the recipe's `rewards:` list.

Each follows TRL's reward protocol: `fn(completions, **columns) -> list[float]`, one value per completion, where
`columns` are the prompt dataset's fields repeated per completion (`answer`, `family`, ...). A completion is the
generated text (a string, or chat messages whose last `content` is the text).

Shipped (for prompts with an `answer`, like `embedded:grpo`):

* `exact_answer`: 1.0 when the completion, whitespace collapsed, is the answer, else 0.0: the same test as the
  recipe's exact match, so its mean is the exact match on the prompts.
* `answer_format`: 1.0 when the completion has the answer's shape (a number for arithmetic, a number and the
  answer's unit for unit conversion, one word of the answer's length for reversal, one line otherwise), else 0.0.
* `answer_similarity`: partial credit in [0, 1]: for a numeric answer, how close the number is (and the unit, when
  there is one); for text, the share of characters in place (difflib ratio). A group whose completions are all
  wrong still differs here, so GRPO has an advantage to follow where `exact_answer` gives none.

`module:function` names your own (imported from the working directory or an installed module).

Example:
    >>> exact_answer(["107", "106"], answer=["107", "107"])
    [1.0, 0.0]
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

from hf_stable.errors import ConfigError

_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: the assistant's messages
        completion = completion[-1]["content"] if completion else ""
    return " ".join(str(completion).strip().split())


def _column(kwargs: dict, name: str, n: int) -> list:
    values = kwargs.get(name)
    if values is None:
        raise ValueError(f"this reward needs the prompt dataset's {name!r} field (a column of the GRPO prompts)")
    if len(values) != n:
        raise ValueError(f"{name!r} has {len(values)} values for {n} completions")
    return list(values)


def exact_answer(completions, answer=None, **kwargs) -> list[float]:
    """1.0 for a completion that is the answer (whitespace collapsed), else 0.0."""
    answers = _column({"answer": answer}, "answer", len(completions))
    return [float(_text(c) == _text(a)) for c, a in zip(completions, answers, strict=True)]


def _shape_ok(text: str, answer: str, family: str | None) -> bool:
    if not text or "\n" in text:
        return False
    number = _NUMBER.match(answer)
    if family == "arithmetic" or (number and number.group() == answer):
        return bool(re.fullmatch(r"-?\d+(?:\.\d+)?", text))
    if number is not None:  # a number and a unit: "27000 米", "4500 m"
        unit = answer[number.end() :].strip()
        got = _NUMBER.match(text)
        return got is not None and text[got.end() :].strip() == unit
    if family == "reversal":
        return " " not in text and len(text) == len(answer)
    return len(text) <= 2 * max(len(answer), 1)


def answer_format(completions, answer=None, family=None, **kwargs) -> list[float]:
    """1.0 for a completion of the answer's shape (see the module docstring), else 0.0."""
    n = len(completions)
    answers = _column({"answer": answer}, "answer", n)
    families = list(family) if family is not None else [None] * n
    return [float(_shape_ok(_text(c), _text(a), f)) for c, a, f in zip(completions, answers, families, strict=True)]


def _closeness(text: str, answer: str) -> float:
    number = _NUMBER.match(answer)
    if number is None:
        return difflib.SequenceMatcher(None, text, answer).ratio()
    got = _NUMBER.match(text)
    if got is None:
        return 0.0
    want, have = float(number.group()), float(got.group())
    near = max(0.0, 1.0 - abs(have - want) / max(abs(want), 1.0))
    unit = answer[number.end() :].strip()
    if not unit:
        return near
    same_unit = text[got.end() :].strip() == unit
    return 0.8 * near + 0.2 * float(same_unit)


def answer_similarity(completions, answer=None, **kwargs) -> list[float]:
    """Partial credit in [0, 1]; 1.0 exactly when `exact_answer` gives 1.0."""
    answers = _column({"answer": answer}, "answer", len(completions))
    out = []
    for c, a in zip(completions, answers, strict=True):
        text, want = _text(c), _text(a)
        out.append(1.0 if text == want else min(_closeness(text, want), 0.99))
    return out


SHIPPED: dict[str, Callable] = {
    "exact_answer": exact_answer,
    "answer_format": answer_format,
    "answer_similarity": answer_similarity,
}


def resolve_reward(name: str) -> Callable:
    """The reward function `name` names: a shipped one, or `module:function`.

    Raises:
        ConfigError: an unknown name, or a `module:function` that cannot be imported or is not callable.
    """
    if name in SHIPPED:
        return SHIPPED[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"rewards: unknown reward {name!r} (shipped: {', '.join(SHIPPED)}; your own: 'module:function')"
        )
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # a module next to the recipe, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module: said in one line
        raise ConfigError(f"rewards: cannot import {module_name!r} for {name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "has no attribute" if fn is None else "is not callable:"
        raise ConfigError(f"rewards: {module_name!r} {what} {attr!r} (for {name!r})")
    return fn


def resolve_rewards(names: list[str]) -> list[Callable]:
    """Every reward `names` lists, each problem reported at once.

    Raises:
        ConfigError: listing each name that cannot be resolved; or an empty list.
    """
    if not names:
        raise ConfigError("rewards: empty; name at least one (e.g. exact_answer)")
    problems, out = [], []
    for name in names:
        try:
            out.append(resolve_reward(name))
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    return out
