"""What the rescue benchmark's runs said: the events table, the results file and the before/after comparison.

* `events_table(results)`: per case x arm (hf_stable's arms; the peers write no events), per seed, the event kinds
  the run raised (`kind xN`, `!` after a warning-level kind, `!!` after an error-level one), skips, rollbacks and
  the LR factor the run ended with and the stability verdict (`hf_stable.reporting.verdict` of this checkout, applied to the run's events).
* `write_json(path, results, meta)` / `read_json(path)`: every result of a run (after `judge`) and how it was made.
* `compare(before, after)`: a markdown table, per case x arm present in both, of the events (union over seeds) and
  eval/clean ratios before and after, with the rows whose event kinds changed marked.

    python benchmarks/rescue.py --compare BEFORE.json AFTER.json
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from rescue_cases import CASES

MARK = {"info": "", "warning": "!", "error": "!!"}


def _kinds(r: dict) -> str:
    kinds = r.get("events")
    if kinds is None:
        return "-"
    return ", ".join(f"{k} x{n}{MARK.get(sev, '!')}" for k, (n, sev) in sorted(kinds.items())) or "none"


def _groups(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in results:
        if r.get("events") is not None:
            groups[(r["case"], r["arm"])].append(r)
    order = {name: i for i, name in enumerate(CASES)}
    for runs in groups.values():
        runs.sort(key=lambda r: r["seed"])
    return dict(sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])))


def events_table(results: list[dict]) -> list[str]:
    """One line per case x arm x seed of the arms that write events."""
    head = f"{'case':<12} {'arm':<12} {'seed':>4} {'verdict':<9} {'skips':>5} {'rollb':>5} {'lr_x':>7}  "
    lines = [head + "events (! warning, !! error)"]
    for (case, arm), runs in _groups(results).items():
        for r in runs:
            lines.append(
                f"{case:<12} {arm:<12} {r['seed']:>4} {r.get('stability') or '-':<9} {r['skips']:>5} "
                f"{r['rollbacks']:>5} {r.get('lr_factor', 1.0):>7.4g}  {_kinds(r)}"
            )
    return lines


def write_json(path: str, results: list[dict], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def read_json(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _union(runs: list[dict]) -> dict[str, str]:
    """{kind: highest severity} over the runs."""
    rank = {"info": 0, "warning": 1, "error": 2}
    out: dict[str, str] = {}
    for r in runs:
        for kind, (_n, sev) in (r.get("events") or {}).items():
            if kind not in out or rank.get(sev, 1) > rank.get(out[kind], 1):
                out[kind] = sev
    return out


def _fmt_kinds(kinds: dict[str, str]) -> str:
    return ", ".join(f"`{k}`{MARK.get(s, '!')}" for k, s in sorted(kinds.items())) or "none"


def _ratios(runs: list[dict]) -> str:
    return "/".join(format(r["ratio"], ".3f") if math.isfinite(r["ratio"]) else "inf" for r in runs)


def compare(before: dict, after: dict) -> list[str]:
    """Markdown rows: case, arm, seeds, events before, after, eval/clean before, after, verdicts before -> after."""
    b, a = _groups(before["results"]), _groups(after["results"])
    lines = [
        (
            f"before: {before['meta'].get('label', '?')} ({before['meta'].get('hf_stable', '?')}); "
            f"after: {after['meta'].get('label', '?')} ({after['meta'].get('hf_stable', '?')}); "
            "! warning-level, !! error-level"
        ),
        "",
        "| case | arm | seeds | events before | events after | eval/clean before | after | verdict before -> after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    changed = kept = 0
    for key, runs_a in a.items():
        runs_b = b.get(key)
        if not runs_b:
            continue
        seeds = sorted({r["seed"] for r in runs_a} & {r["seed"] for r in runs_b})
        runs_a = [r for r in runs_a if r["seed"] in seeds]
        runs_b = [r for r in runs_b if r["seed"] in seeds]
        kb, ka = _union(runs_b), _union(runs_a)
        lost = sorted(set(kb) - set(ka))
        changed += bool(lost or set(ka) - set(kb))
        kept += not lost
        verdicts = f"{'/'.join(r.get('stability') or '-' for r in runs_b)} -> {'/'.join(r.get('stability') or '-' for r in runs_a)}"
        mark = f" (lost: {', '.join(lost)})" if lost else ""
        lines.append(
            f"| {key[0]} | {key[1]} | {','.join(map(str, seeds))} | {_fmt_kinds(kb)} | {_fmt_kinds(ka)}{mark} | "
            f"{_ratios(runs_b)} | {_ratios(runs_a)} | {verdicts} |"
        )
    n = len(lines) - 4
    lines.append("")
    lines.append(f"rows={n} kept_every_event_kind={kept}/{n} rows_with_changed_kinds={changed}")
    return lines
