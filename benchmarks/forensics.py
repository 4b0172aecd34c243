"""Spike-forensics benchmark: known bad records mixed into the embedded training file; does the quarantine find them?

    python benchmarks/forensics.py                 # embedded default, 130 steps (about one epoch) per run
    python benchmarks/forensics.py --records 600 --steps 42     # one epoch of a 600-record subset: quicker

Each run is the recipe itself (`scripts/finetune.py`, subprocess) on the embedded default with the training file
replaced by a poisoned copy: the 2000 embedded records plus, at seeded random lines,

* ``garbage``   - random characters from several scripts as instruction and answer (byte noise after cleaning);
* ``mislabeled`` - a record's question with the answer of a record of another task family;
* ``repeated``  - an answer of one character repeated past ``max_length`` (truncated, EOS kept);
* ``burst``     - garbage records on consecutive lines (the sampler shuffles, so they land in different batches).

Arms (same seed, same file): ``screen`` (``data.quarantine: auto``, ``data.screen: true``), ``auto`` (no
screening: only bad steps are attributed), ``report`` (file only, keeps training on them) and ``plain`` (no
monitors, guards or forensics). Reported per arm: the quarantine's precision and recall against the injected
lines (per kind), eval loss; then the clean embedded file with screening on over ``--clean-seeds`` seeds
(quarantined records = false positives) and screening's step-time overhead (train runtime, screen vs auto on the
clean file: a wall-time ratio, noisy on a shared machine). The last line:

    quarantine_precision=… quarantine_recall=… screen_overhead=… clean_false_positives=…
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "hf_stable" / "embedded" / "data" / "train.jsonl"
KINDS = ("garbage", "mislabeled", "repeated", "burst")
SCRIPTS = [
    "abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    "αβγδεζηθικλμνξοπρστυφχψω",
    "абвгдежзийклмнопрстуфхцчшщ",
    "的一是不了人我在有他这中大来上们到说国和地也子时道出",
    "!@#$%^&*()_+-=[]{};:,.<>/?~",
]


def _noise(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(rng.choice(SCRIPTS)) for _ in range(n))


def base_records(n: int | None) -> list[dict]:
    records = [json.loads(x) for x in EMBEDDED.read_text(encoding="utf-8").splitlines() if x.strip()]
    return records[:n] if n else records


def clean_file(path: Path, n: int | None) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in base_records(n)), encoding="utf-8")
    return path


def poisoned_file(path: Path, seed: int, per_kind: int = 5, n: int | None = None) -> dict[int, str]:
    """Write the (first `n`) embedded records plus `per_kind` bad records of each kind; returns {line: kind}."""
    rng = random.Random(seed)
    records = base_records(n)
    bad: list[tuple[str, dict]] = []
    for _ in range(per_kind):
        bad.append(("garbage", {"instruction": _noise(rng, 40), "input": "", "output": _noise(rng, 60)}))
        a = rng.choice(records)
        b = rng.choice([r for r in records if r.get("family") != a.get("family")])
        bad.append(
            ("mislabeled", {"instruction": a["instruction"], "input": a.get("input", ""), "output": b["output"]})
        )
        bad.append(
            (
                "repeated",
                {"instruction": rng.choice(records)["instruction"], "input": "", "output": rng.choice("xZ#7") * 400},
            )
        )
    burst = [
        ("burst", {"instruction": _noise(rng, 40), "input": "", "output": _noise(rng, 60)}) for _ in range(per_kind)
    ]
    lines: list[tuple[str | None, dict]] = [(None, r) for r in records]
    for kind, rec in bad:
        lines.insert(rng.randrange(len(lines) + 1), (kind, rec))
    at = rng.randrange(len(lines) + 1)
    lines[at:at] = burst
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for _, r in lines), encoding="utf-8")
    return {k + 1: kind for k, (kind, _) in enumerate(lines) if kind is not None}


def run(train_file: Path, out: Path, arm: str, seed: int, steps: int) -> dict:
    """One recipe run; returns its quarantine entries, eval loss and train runtime."""
    args = [
        sys.executable,
        str(ROOT / "scripts" / "finetune.py"),
        "--data.train_file",
        str(train_file),
        "--training.max_steps",
        str(steps),
        "--training.seed",
        str(seed),
        "--training.output_dir",
        str(out),
        "--evaluation.exact_match_samples",
        "0",
        "--evaluation.before",
        "false",
        "--training.logging_steps",
        "10",
    ]
    if arm == "plain":
        args += [
            "--data.quarantine",
            "off",
            "--stability.guards.enabled",
            "false",
            "--stability.monitors.enabled",
            "false",
        ]
    else:
        args += [
            "--data.quarantine",
            "report" if arm == "report" else "auto",
            "--data.screen",
            "true" if arm in ("screen", "report") else "false",
        ]
    started = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} run failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "run_summary.json").read_text())
    state = json.loads((out / "trainer_state.json").read_text())
    runtime = next((h["train_runtime"] for h in state["log_history"] if "train_runtime" in h), time.time() - started)
    q = out / "quarantine.jsonl"
    entries = [json.loads(x) for x in q.read_text().splitlines() if x.strip()] if q.is_file() else []
    return {
        "entries": entries,
        "eval_loss": summary.get("eval_loss_after"),
        "runtime": float(runtime),
        "steps": summary.get("train_steps"),
    }


def score(entries: list[dict], injected: dict[int, str]) -> dict:
    lines = {int(e["where"].rsplit(":", 1)[1]) for e in entries}
    hit = lines & set(injected)
    by_kind = {
        k: (sum(1 for ln in hit if injected[ln] == k), sum(1 for v in injected.values() if v == k)) for k in KINDS
    }
    return {
        "quarantined": len(lines),
        "true": len(hit),
        "precision": len(hit) / len(lines) if lines else 1.0,
        "recall": len(hit) / len(injected),
        "by_kind": by_kind,
        "false": sorted(lines - set(injected)),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=130, help="optimizer steps per run (16 records each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-kind", type=int, default=5)
    p.add_argument("--clean-seeds", type=int, default=3)
    p.add_argument("--records", type=int, default=None, help="use only the first N embedded records (shorter epochs)")
    p.add_argument("--arms", default="screen,auto,report,plain")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hf_stable_forensics_"))
    train = tmp / "train_poisoned.jsonl"
    injected = poisoned_file(train, a.seed, a.per_kind, a.records)
    clean = clean_file(tmp / "train_clean.jsonl", a.records)
    print(f"{len(injected)} bad records injected into {train} ({a.steps} steps per run)")
    results = {}
    for arm in a.arms.split(","):
        r = run(train, tmp / arm, arm, a.seed, a.steps)
        results[arm] = r
        s = score(r["entries"], injected) if arm != "plain" else None
        kinds = " ".join(f"{k} {t}/{n}" for k, (t, n) in s["by_kind"].items()) if s else ""
        print(
            f"{arm:>7}: eval loss {r['eval_loss']:.4f}  runtime {r['runtime']:.0f}s"
            + (
                f"  quarantined {s['quarantined']} (true {s['true']}) precision {s['precision']:.2f} "
                f"recall {s['recall']:.2f}  [{kinds}]  false: {s['false'][:5]}"
                if s
                else ""
            )
        )
    clean_fp, runtimes = [], {}
    for k in range(a.clean_seeds):
        r = run(clean, tmp / f"clean_screen_{k}", "screen", a.seed + k, a.steps)
        clean_fp.append(len(r["entries"]))
        runtimes.setdefault("screen", []).append(r["runtime"])
        print(
            f"clean seed {a.seed + k}: {len(r['entries'])} quarantined (screening on) "
            f"{[e['where'] for e in r['entries']][:5]}"
        )
    r = run(clean, tmp / "clean_auto", "auto", a.seed, a.steps)
    overhead = runtimes["screen"][0] / r["runtime"] if r["runtime"] else float("nan")
    print(
        f"screen overhead (train runtime, clean file, seed {a.seed}): {overhead:.3f}x "
        "(wall time on a possibly shared machine: noisy)"
    )
    s = (
        score(results["screen"]["entries"], injected)
        if "screen" in results
        else {"precision": float("nan"), "recall": float("nan")}
    )
    print(
        f"quarantine_precision={s['precision']:.3f} quarantine_recall={s['recall']:.3f} "
        f"screen_overhead={overhead:.3f} clean_false_positives={sum(clean_fp)}"
    )


if __name__ == "__main__":
    main()
