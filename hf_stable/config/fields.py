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


def config_from(cls, config=None, overrides: dict | None = None):
    """The config object a callback runs with: `config` (default: `cls()`) with `overrides` applied by field name.

    This is what lets a callback take its config section (`SkipGuard(SkipConfig(window=20))`) and still be built
    from keywords (`SkipGuard(window=20)`) while each default lives in the dataclass only. Built from keywords
    alone, a section with an `enabled` field is switched on: constructing a callback asks for it (opt-in sections
    such as `snr` are off only in the recipe's config).

    Raises:
        TypeError: `config` is not a `cls`, or an override names no field of `cls`.
    """
    import dataclasses

    overrides = dict(overrides or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)} (fields: {', '.join(sorted(names))})")
    if config is None:
        if "enabled" in names:
            overrides.setdefault("enabled", True)
        return cls(**overrides)
    if not isinstance(config, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(config).__name__}")
    return dataclasses.replace(config, **overrides) if overrides else config
