"""Verdicts and the printed tables of the rescue benchmark (from the list of run results).

* ratio = final eval loss / the plain arm's clean-run eval loss (same seed, same base; the DDP cases against the
  DDP clean run).
* verdict: `stopped` (the mechanism ended training: failed, judged by its last checkpoint), `split` (DDP ranks
  ended with different weights), `diverged` (non-finite, or more than half of the clean run's gain over the base
  lost: eval > (clean + before) / 2), `ok` (within 5 % of the clean run), else `degraded`. The plain arm's `ok` on a stress case prints as `survived`: the
  baseline did not fail there, so no arm rescued anything.
* noise = 2 x the relative standard deviation over seeds of the plain clean eval loss (1 % with one seed).
* best peer = the peer arm (plain included) with the most ok runs over the cases hf_stable ran. hf_stable is not
  worse than it on a case x seed when it is ok, or its score <= the peer's + noise (score: the ratio; a stopped run
  scores its checkpoint's ratio; a non-finite or split run scores infinity).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from rescue_cases import CASES
from rescue_harness import PEERS

TOLERANCE = 0.05
REFERENCE_ONLY = {"clean_deep", "clean_wide", "ddp_clean"}  # run for their plain reference (and opt-ins)


def judge(results: list[dict], before: dict[str, float]) -> tuple[list[dict], float]:
    """Adds `ratio`, `verdict` and `score` to every result; returns them and the noise level."""
    ref = {(r["case"], r["seed"]): r["eval_loss"] for r in results if r["arm"] == "plain"}
    plain_cpu = {(r["case"], r["seed"]): r["cpu_s"] for r in results if r["arm"] == "plain"}
    for r in results:
        case = CASES[r["case"]]
        clean = ref.get((case.clean, r["seed"]), math.nan)
        x = r["eval_loss"]
        r["ratio"] = x / clean if math.isfinite(x) else math.inf
        r["cpu_x"] = r["cpu_s"] / plain_cpu.get((r["case"], r["seed"]), math.nan)
        if r.get("stopped") is not None:
            r["verdict"] = "stopped"
        elif r.get("ranks_identical") is False:
            r["verdict"] = "split"
        elif not math.isfinite(x) or x > (clean + before[case.base]) / 2:
            r["verdict"] = "diverged"
        else:
            r["verdict"] = "ok" if r["ratio"] <= 1 + TOLERANCE else "degraded"
        failed_hard = not math.isfinite(x) or r["verdict"] == "split"
        r["score"] = math.inf if failed_hard else r["ratio"]
    cleans = [r["eval_loss"] for r in results if r["case"] == "clean" and r["arm"] == "plain"]
    noise = 2 * statistics.stdev(cleans) / statistics.fmean(cleans) if len(cleans) > 1 else 0.01
    return results, noise


def _fmt(x: float, spec: str = ".3f") -> str:
    return format(x, spec) if math.isfinite(x) else ("inf" if x > 0 else "nan")


def table(results: list[dict]) -> list[str]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["case"], r["arm"])].append(r)
    lines = [
        (
            f"{'case':<12} {'arm':<16} {'eval/clean per seed':<22} {'verdicts':<26} {'skips':<9} {'rollb':<7} "
            f"{'cpu_x':>5}  {'max_logit (final/peak)'}"
        )
    ]
    order = {name: i for i, name in enumerate(CASES)}
    for (case, arm), runs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1] != "plain")):
        runs.sort(key=lambda r: r["seed"])
        verdicts = [
            ("survived" if arm == "plain" and v == "ok" and case != CASES[case].clean else v)
            for v in (r["verdict"] for r in runs)
        ]
        logits = "/".join(f"{_fmt(r['logit_final'], '.1f')}/{_fmt(r['logit_peak'], '.1f')}" for r in runs)
        cpu = statistics.fmean(r["cpu_x"] for r in runs)
        lines.append(
            f"{case:<12} {arm:<16} {'/'.join(_fmt(r['ratio']) for r in runs):<22} {','.join(verdicts):<26} "
            f"{'/'.join(str(r['skips']) for r in runs):<9} {'/'.join(str(r['rollbacks']) for r in runs):<7} "
            f"{_fmt(cpu, '.2f'):>5}  {logits if CASES[case].logits else ''}"
        )
    return lines


def summary(results: list[dict], noise: float) -> list[str]:
    """`arm=... ok=N/M` per arm, the cases where a peer beat hf_stable, and the last line."""
    judged = [r for r in results if r["case"] not in REFERENCE_ONLY]
    by_arm: dict[str, list[dict]] = defaultdict(list)
    for r in judged:
        by_arm[r["arm"]].append(r)
    # every clean case the arm ran (clean, clean_deep ...) against plain's run of it
    plain_clean = {(r["case"], r["seed"]): r["score"] for r in results if r["arm"] == "plain"}
    is_clean = {r["case"] for r in results if CASES[r["case"]].clean == r["case"]}
    lines = []
    for arm, runs in by_arm.items():
        ok = sum(r["verdict"] == "ok" for r in runs)
        clean = [
            r["score"] - plain_clean[(r["case"], r["seed"])]
            for r in results
            if r["arm"] == arm and r["case"] in is_clean and (r["case"], r["seed"]) in plain_clean
        ]
        worse = max(clean) if clean else math.nan
        flag = " WORSE THAN PLAIN ON CLEAN" if clean and worse > noise else ""
        lines.append(f"arm={arm} ok={ok}/{len(runs)} clean_vs_plain={_fmt(worse, '+.4f')}{flag}")
    hf = {(r["case"], r["seed"]): r for r in by_arm.get("hf_stable", [])}
    if not hf:
        return lines
    peer_ok = {
        arm: sum(r["verdict"] == "ok" for r in by_arm[arm] if (r["case"], r["seed"]) in hf)
        for arm in PEERS
        if arm in by_arm
    }
    best = max(peer_ok, key=lambda a: peer_ok[a]) if peer_ok else None
    best_runs = {(r["case"], r["seed"]): r for r in by_arm.get(best, [])}
    not_worse = 0
    for key, h in sorted(hf.items()):
        p = best_runs.get(key)
        not_worse += h["verdict"] == "ok" or p is None or h["score"] <= p["score"] + noise
        for arm in peer_ok:  # every peer that beat hf_stable here, for the README's discussion
            q = next((r for r in by_arm[arm] if (r["case"], r["seed"]) == key), None)
            if q is not None and h["verdict"] != "ok" and (q["verdict"] == "ok" or q["score"] + noise < h["score"]):
                lines.append(
                    f"peer_beats_hf_stable: case={key[0]} seed={key[1]} peer={arm} "
                    f"{q['verdict']} {_fmt(q['score'])} vs hf_stable {h['verdict']} {_fmt(h['score'])}"
                )
    n = len(hf)
    lines.append(f"noise={noise:.4f} (2 x relative std over seeds of plain's clean eval loss); best peer: {best}")
    lines.append(
        f"hf_stable_ok={sum(r['verdict'] == 'ok' for r in hf.values())}/{n} "
        f"best_peer_ok={peer_ok.get(best, 0)}/{n} hf_stable_not_worse_than_best_peer={not_worse}/{n}"
    )
    return lines
