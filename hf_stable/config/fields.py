"""Small helpers every config section uses: field help metadata and shared validation rules."""

from __future__ import annotations


def help_(text: str) -> dict:
    """`field(metadata=help_("..."))`: the help text shown in docs/CONFIG.md."""
    return {"help": text}


def check_positive(obj, names: tuple[str, ...], out: list[str], strict: bool = True) -> None:
    """Append "name: got X, must be > 0" (or ">= 0" when not strict) for each offending field; None is allowed."""
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        if (strict and not value > 0) or (not strict and value < 0):
            out.append(f"{name}: got {value}, must be {'> 0' if strict else '>= 0'}")


def check_unit_interval(obj, names: tuple[str, ...], out: list[str]) -> None:
    """Append "name: got X, must be in (0, 1)" for each field outside the open unit interval."""
    for name in names:
        value = getattr(obj, name)
        if not 0.0 < value < 1.0:
            out.append(f"{name}: got {value}, must be in (0, 1)")
