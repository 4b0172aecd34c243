"""YAML → typed dataclasses, with dotted CLI overrides and one `ConfigError` listing every problem.

The machinery is generic: a section is a plain dataclass whose fields carry `metadata={"help": ...}`
and may define `validate() -> list[str]` for rules that types cannot express. Type checks (including
`Literal` choices), unknown keys and the section's own rules are all collected before raising.

YAML anchors and aliases (`&a` / `*a`) share one object however often it is referenced, so nine levels of nine
aliases load in microseconds but stand for 9**9 values: anything that walks the tree (a message showing a
value, `dataclasses.asdict`) would then run for hours. `check_size` refuses a tree with more than
`MAX_CONFIG_VALUES` values counted with repetition, and messages show values through `show` (a bounded repr).
"""

from __future__ import annotations

import dataclasses
import difflib
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from hf_stable.errors import ConfigError

_MISSING = object()
MAX_CONFIG_VALUES = 100_000  # a real recipe holds a few hundred
_ENDLESS = 10**18

_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict, _REPR.maxlevel = 80, 80, 6, 6, 3


# names other libraries give a field of ours (peft's `lora_alpha`, "rank" for `r`): string similarity misses them
_SYNONYMS = {
    "rank": "r",
    "lora_r": "r",
    "lora_rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "lr": "learning_rate",
}


def did_you_mean(key: str, choices) -> list[str]:
    """Up to three of `choices` that `key` was probably meant to be: a known synonym, a close spelling (difflib), or
    a name containing `key` with the underscores ignored (`learning_rat` -> `learning_rate`). Spellings much
    further from `key` than the closest one are left out (`on_bad_records` -> `on_bad_record`, not also
    `eval_max_records`)."""
    choices = [str(c) for c in choices]
    out = [c for c in (_SYNONYMS.get(key),) if c in choices]
    close = difflib.get_close_matches(key, choices, n=3, cutoff=0.6)
    ratio = {c: difflib.SequenceMatcher(None, key, c).ratio() for c in close}
    out += [c for c in close if ratio[c] >= ratio[close[0]] - 0.15]
    squashed = key.replace("_", "")
    if len(squashed) >= 4:
        out += [c for c in choices if squashed in c.replace("_", "")]
    return list(dict.fromkeys(out))[:3]


def show(value: Any) -> str:
    """`repr(value)` cut to a few dozen characters, in time bounded whatever the value's size."""
    return _REPR.repr(value)


def _expanded_size(node: Any, memo: dict[int, int], active: set[int]) -> int:
    """Values in `node` counted with repetition (a shared sub-tree each time it occurs); a cycle is endless."""
    if not isinstance(node, (dict, list)):
        return 1
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:  # a recursive alias (`&a [*a]`)
        return _ENDLESS
    active.add(key)
    children = node.values() if isinstance(node, dict) else node
    total = min(_ENDLESS, 1 + sum(_expanded_size(child, memo, active) for child in children))
    active.discard(key)
    memo[key] = total
    return total


def check_size(data: Any, where: str) -> None:
    """Refuse a config tree that expands to more than `MAX_CONFIG_VALUES` values (a YAML alias bomb).

    Raises:
        ConfigError: naming `where` and the innermost key whose expansion alone is too large.
    """
    memo: dict[int, int] = {}
    if _expanded_size(data, memo, set()) <= MAX_CONFIG_VALUES:
        return
    path, node, seen = [], data, {id(data)}
    while True:  # walk down to the innermost key that is still too large on its own
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        big = next(((k, v) for k, v in items if memo.get(id(v), 1) > MAX_CONFIG_VALUES), None)
        if big is None or id(big[1]) in seen:  # the end, or the recursion closes
            break
        seen.add(id(big[1]))
        path.append(str(big[0]))
        node = big[1]
    size = memo[id(node)]
    amount = "an endless recursive alias" if size >= _ENDLESS else f"{size:,} values"
    raise ConfigError(
        f"{where}: {'.'.join(path) or 'the top level'} expands to {amount} through YAML anchors/aliases "
        f"(&name / *name), more than the {MAX_CONFIG_VALUES:,} a config may hold; write the values out or nest "
        "fewer aliases",
        source=where,
    )


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        return f"a list of {_type_name(inner)}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping (section {tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Return `value` converted to type `tp`, or `_MISSING` after appending a problem naming `key`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            out = coerce(value, arg, key, trial)
            if not trial:
                return out
        problems.append(f"{key}: got {show(value)}, expected {_type_name(tp)}")
        return _MISSING
    if origin is Literal:
        word = ("on" if value else "off") if isinstance(value, bool) else None
        if word is not None and word in get_args(tp):  # YAML 1.1 reads a bare off / on as a boolean
            return word
        if value in get_args(tp):
            return value
        problems.append(f"{key}: got {show(value)}, allowed: {_type_name(tp)}")
        return _MISSING
    if origin is list:
        (inner,) = get_args(tp) or (Any,)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            problems.append(f"{key}: got {show(value)}, expected {_type_name(tp)}")
            return _MISSING
        out = [coerce(v, inner, f"{key}[{i}]", problems) for i, v in enumerate(value)]
        return _MISSING if any(v is _MISSING for v in out) else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            problems.append(f"{key}: got {show(value)}, expected a mapping")
            return _MISSING
        args = get_args(tp)
        if len(args) == 2:
            out = {k: coerce(v, args[1], f"{key}.{k}", problems) for k, v in value.items()}
            return _MISSING if any(v is _MISSING for v in out.values()) else out
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            problems.append(f"{key}: got {show(value)}, expected {_type_name(tp)}")
            return _MISSING
        return build_section(tp, value, key, problems)
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{key}: got {show(value)}, expected true or false")
        return _MISSING
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        problems.append(f"{key}: got {show(value)}, expected an integer")
        return _MISSING
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        problems.append(f"{key}: got {show(value)}, expected a number")
        return _MISSING
    if tp is str:
        if isinstance(value, str):
            return value
        problems.append(f"{key}: got {show(value)}, expected a string")
        return _MISSING
    return value


def build_section(cls: type, data: dict, prefix: str, problems: list[str]) -> Any:
    """Build dataclass `cls` from `data`, appending every problem (keys named `prefix.field`) to `problems`."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            close = did_you_mean(str(key), fields)
            hint = f", did you mean {' or '.join(close)}?" if close else ""
            problems.append(f"{full}: unknown key{hint} (allowed in '{prefix or 'top level'}': {allowed})")
            continue
        out = coerce(value, hints[key], full, problems)
        if out is not _MISSING:
            kwargs[key] = out
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        problems.append(f"{prefix or 'top level'}: {e}")
        return _MISSING
    n_before = len(problems)
    validate = getattr(obj, "validate", None)
    if callable(validate) and n_before == len(problems):
        for p in validate() or []:
            problems.append(f"{prefix}.{p}" if prefix else p)
    return obj


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: '{part}' is not a section, cannot set a sub-key")
        node = child
    node[parts[-1]] = value


def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    """Split `--config PATH` and `--a.b VALUE` / `--a.b=VALUE` pairs. Values are parsed as YAML scalars."""
    config_path = None
    overrides: list[tuple[str, Any]] = []
    problems = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            problems.append(f"{arg}: unexpected argument (use --config PATH and --section.key VALUE)")
            i += 1
            continue
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                problems.append(f"--{key}: missing value")
                break
            val = argv[i + 1]
            i += 1
        i += 1
        if key == "config":
            config_path = val
            continue
        try:
            parsed = yaml.safe_load(val) if val != "" else ""
        except yaml.YAMLError:
            parsed = val
        overrides.append((key, parsed))
    if problems:
        raise ConfigError(problems, source="command line")
    return config_path, overrides


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} (pass --config PATH to an existing YAML file)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})", source=str(path)) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})", source=str(path)) from None
    if data is None:
        data = {}
    check_size(data, str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data
