"""Spike-forensics benchmark: known bad records mixed into the embedded training file; does the quarantine find them?

    python benchmarks/forensics.py                 # embedded default: 130 steps (one epoch of 2000 records) per run
    python benchmarks/forensics.py --warm-steps 0 --records 600 --steps 42     # quicker, cold base

The base. A mislabeled answer is only wrong to a model that knows the task: a pretrained LLM does, the embedded tiny
base does not (its loss on a correct but hard answer is as high as on a wrong one). So by default the embedded base
is first fine-tuned on the *clean* embedded file (``--warm-steps`` LoRA steps, its own seed, then merged) and every
arm starts from that warm base - the position of a user fine-tuning a capable base. ``--warm-steps 0``: the cold
embedded base.

Each run is the recipe itself (`scripts/finetune.py`, subprocess) with the training file replaced by a poisoned
copy: the embedded records plus, at seeded random lines,

* ``garbage``   - random characters from several scripts as instruction and answer (byte noise after cleaning);
* ``mislabeled`` - a record's question with the answer of a record of another task family;
* ``repeated``  - an answer of one character repeated past ``max_length`` (truncated, EOS kept);
* ``burst``     - garbage records on consecutive lines (the sampler shuffles, so they land in different batches).

Arms (same seed, same file): ``screen`` (``data.quarantine: auto``, ``data.screen: true``), ``auto`` (no
screening: only bad steps are attributed), ``report`` (file only, keeps training on them) and ``plain`` (no
monitors, guards or forensics). Reported per arm: the quarantine's precision and recall against the injected
lines (per kind), eval loss over the clean run's; bad steps attributed and their forensics' cost in steps. Then the
clean file with screening on over ``--clean-seeds`` seeds (quarantined records = false positives), each next to the
same seed without screening: screening's step-time overhead is the ratio of their summed train runtimes (the arms
alternate, one run at a time: time nothing else on the machine meanwhile). The last line:

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


def mislabeled_file(path: Path, seed: int, rate: float, n: int | None = None) -> dict[int, str]:
    """The (first `n`) embedded records with `rate` of them mislabeled in place: each chosen record gets the answer
    of a random record of another task family in the same language (nothing else changes). Returns {line: kind}."""
    rng = random.Random(seed)
    records = base_records(n)
    chosen = sorted(rng.sample(range(len(records)), round(rate * len(records))))
    for k in chosen:
        a = records[k]
        b = rng.choice([r for r in records if r.get("family") != a.get("family") and r.get("lang") == a.get("lang")])
        records[k] = {**a, "output": b["output"]}
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return {k + 1: "mislabeled" for k in chosen}


def run(
    train_file: Path, out: Path, arm: str, seed: int, steps: int, base: Path | None = None, epochs: int = 0
) -> dict:
    """One recipe run (`steps` steps, or `epochs` whole epochs when given); returns its quarantine entries, eval
    loss, train runtime and attributed bad steps."""
    length = ["--training.num_train_epochs", str(epochs), "--training.max_steps", "-1"] if epochs else []
    args = [
        sys.executable,
        str(ROOT / "scripts" / "finetune.py"),
        "--data.train_file",
        str(train_file),
        *(length or ["--training.max_steps", str(steps)]),
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
    if base is not None:
        args += ["--model.name_or_path", str(base)]
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
    logged = {k: v for h in state["log_history"] for k, v in h.items() if k.startswith("perf/forensics")}  # cumulative
    ev = out / "stability_events.jsonl"
    events = [json.loads(x) for x in ev.read_text().splitlines() if x.strip()] if ev.is_file() else []
    return {
        "entries": entries,
        "eval_loss": summary.get("eval_loss_after"),
        "runtime": float(runtime),
        "steps": summary.get("train_steps") or steps,
        "screen_s": float(logged.get("perf/forensics_screen_s", 0.0)),
        "bad_steps": sum(1 for e in events if e.get("kind") == "step_forensics"),
        "state": state.get("stateful_callbacks", {}).get("hf_stable", {}).get("SpikeForensics", {}),
        "forensics_s": float(logged.get("perf/forensics_s", 0.0)),
        "trajectory_s": float(logged.get("perf/forensics_trajectory_s", 0.0)),
    }


def warm_base(tmp: Path, clean: Path, steps: int) -> Path:
    """The embedded base after `steps` LoRA steps on the clean file (seed 1000), merged: a base that does the tasks."""
    out = tmp / "warm_run"
    run(clean, out, "plain", 1000, steps)
    code = (
        "import sys, glob; from pathlib import Path\n"
        "from peft import AutoPeftModelForCausalLM; from transformers import AutoTokenizer\n"
        "src, dst = sys.argv[1], sys.argv[2]\n"
        "AutoPeftModelForCausalLM.from_pretrained(src).merge_and_unload().save_pretrained(dst)\n"
        "AutoTokenizer.from_pretrained(src).save_pretrained(dst)\n"
    )
    dst = tmp / "warm_base"
    subprocess.run([sys.executable, "-c", code, str(out), str(dst)], check=True, cwd=ROOT, capture_output=True)
    return dst


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


def by_epoch(entries: list[dict], injected: dict[int, str], epochs: int) -> list[dict]:
    """`score` of the entries named by the end of each epoch (an entry's ``epoch``: the sampler's epoch when it was
    named, or the epoch a trajectory verdict judged), with and without the trajectory rule's."""
    out = []
    for e in range(1, epochs + 1):
        upto = [x for x in entries if x["epoch"] < e]
        local = [x for x in upto if x["reason"] != "trajectory"]
        out.append({"all": score(upto, injected), "step_local": score(local, injected)})
    return out


def table_until(state: dict, step: int):
    """The run's trajectory table (from its final callback state) as it stood after `step`: later sightings
    dropped."""
    import math

    import torch

    from hf_stable.forensics.trajectory import STEP, TrajectoryTable

    table = TrajectoryTable()
    table.load_state_dict(state.get("trajectory") or {})
    kept = table.seen.clamp(max=table.max_sightings)
    later = table.hist[..., STEP] > step
    table.hist[later] = math.nan
    table.seen = torch.minimum(kept, (~later & torch.isfinite(table.hist[..., STEP])).sum(1).int())
    return table


def calibrate(a, tmp: Path, clean: Path, base: Path | None) -> None:
    """The trajectory rule's scores on clean runs (``report``: nothing left out) at the end of every epoch: the bar
    must sit above every one of them."""
    from hf_stable.forensics.config import ForensicsConfig

    cfg = ForensicsConfig()
    steps_per_epoch = -(-len(base_records(a.records)) // 16)
    top, top_early = [], []
    for seed in [int(x) for x in a.calibrate.split(",")]:
        for epochs in [int(x) for x in a.epochs.split(",")]:
            r = run(clean, tmp / f"calib_{seed}_{epochs}", "report", seed, 0, base, epochs=epochs)
            for e in range(1, epochs + 1):
                table = table_until(r["state"], e * steps_per_epoch)
                v = table.judge(
                    min_sightings=cfg.trajectory_min_sightings,
                    zscore=-1e9,
                    early_zscore=-1e9,
                    gain_weight=cfg.trajectory_gain_weight,
                )
                for early in (True, False):
                    part = [x for x in v if (x.evidence["sightings"] < cfg.trajectory_min_sightings) == early]
                    if not part:
                        continue
                    bar = cfg.trajectory_early_zscore if early else cfg.trajectory_zscore
                    (top_early if early else top).append(part[0].score)
                    print(
                        f"clean seed {seed}, {epochs} epoch(s), end of epoch {e}, records seen "
                        f"{'once' if early else 'twice or more'}: highest score {part[0].score:.3f} (record "
                        f"{part[0].record_id}); named at the bar {bar:g}: {sum(x.score > bar for x in part)}"
                    )
    print(
        f"calibration: highest clean score {max(top):.3f} of records seen twice or more over {len(top)} epoch ends "
        f"(bar {cfg.trajectory_zscore:g}); {max(top_early):.3f} of records seen once over {len(top_early)} "
        f"(bar {cfg.trajectory_early_zscore:g})"
    )


def mislabeled_grid(a, tmp: Path, clean: Path, base: Path | None) -> None:
    """The mislabeled-pair poison at each rate, for each run length: the screened run (``auto``, screening and
    trajectories) against the plain run of the clean file, scored at the end of every epoch."""
    for rate in [float(x) for x in a.mislabeled.split(",")]:
        train = tmp / f"train_mislabeled_{rate:g}.jsonl"
        injected = mislabeled_file(train, a.seed, rate, a.records)
        for epochs in [int(x) for x in a.epochs.split(",")]:
            ref = run(clean, tmp / f"clean_plain_{epochs}", "plain", a.train_seed, 0, base, epochs=epochs)
            r = run(train, tmp / f"mislabeled_{rate:g}_{epochs}", "screen", a.train_seed, 0, base, epochs=epochs)
            overhead = r["runtime"] / (r["runtime"] - r["screen_s"])
            for e, sc in enumerate(by_epoch(r["entries"], injected, epochs), start=1):
                s, loc = sc["all"], sc["step_local"]
                print(
                    f"mislabeled {rate:.0%} ({len(injected)}), {epochs} epoch(s), end of epoch {e}: "
                    f"precision {s['precision']:.3f} recall {s['recall']:.3f} (named {s['quarantined']}, "
                    f"true {s['true']}); step-local only: precision {loc['precision']:.3f} recall {loc['recall']:.3f}"
                )
            print(
                f"  eval loss {r['eval_loss']:.4f} vs clean {ref['eval_loss']:.4f} ({r['eval_loss'] / ref['eval_loss']:.3f}x);"
                f" screening + trajectory work {r['screen_s']:.2f}s (trajectory {r['trajectory_s']:.2f}s) in"
                f" {r['runtime']:.1f}s: overhead {overhead:.3f}x;"
                f" false: {s['false'][:8]}"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=130, help="optimizer steps per run (16 records each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-kind", type=int, default=5)
    p.add_argument("--clean-seeds", type=int, default=3)
    p.add_argument("--records", type=int, default=None, help="use only the first N embedded records (shorter epochs)")
    p.add_argument(
        "--warm-steps", type=int, default=400, help="LoRA steps of the warm base on the clean file (0: cold)"
    )
    p.add_argument("--base", type=Path, default=None, help="a warm base built earlier (skips the warm-up runs)")
    p.add_argument("--arms", default="screen,auto,report,plain")
    p.add_argument(
        "--mislabeled", default=None, help="rates of the mislabeled-pair poison, e.g. 0.01,0.05 (its own grid)"
    )
    p.add_argument("--epochs", default="1,2,3", help="--mislabeled: whole epochs per run")
    p.add_argument("--train-seed", type=int, default=3, help="--mislabeled: training seed (the poison: --seed)")
    p.add_argument(
        "--calibrate", default=None, help="clean training seeds, e.g. 0,1,2: the trajectory rule's clean scores"
    )
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hf_stable_forensics_"))
    train = tmp / "train_poisoned.jsonl"
    injected = poisoned_file(train, a.seed, a.per_kind, a.records)
    clean = clean_file(tmp / "train_clean.jsonl", a.records)
    base = a.base
    if base is None and a.warm_steps:
        started = time.time()
        base = warm_base(tmp, clean, a.warm_steps)
        print(f"warm base: {a.warm_steps} LoRA steps on the clean file, merged ({time.time() - started:.0f}s)")
    if a.calibrate:
        return calibrate(a, tmp, clean, base)
    if a.mislabeled:
        return mislabeled_grid(a, tmp, clean, base)
    print(f"{len(injected)} bad records injected into {train} ({a.steps} steps per run)")
    clean_ref = run(clean, tmp / "clean_plain", "plain", a.seed, a.steps, base)
    print(f"  clean: eval loss {clean_ref['eval_loss']:.4f} (plain, clean file: the reference)")
    results = {}
    for arm in a.arms.split(","):
        r = run(train, tmp / arm, arm, a.seed, a.steps, base)
        results[arm] = r
        s = score(r["entries"], injected) if arm != "plain" else None
        kinds = " ".join(f"{k} {t}/{n}" for k, (t, n) in s["by_kind"].items()) if s else ""
        step_s = r["runtime"] / max(r["steps"], 1)
        cost = (
            f"  bad steps attributed {r['bad_steps']}, forensics {r['forensics_s'] / r['bad_steps'] / step_s:.2f} steps each"
            if r["bad_steps"]
            else ""
        )
        print(
            f"{arm:>7}: eval loss {r['eval_loss']:.4f} ({r['eval_loss'] / clean_ref['eval_loss']:.3f}x clean)"
            + (
                f"  quarantined {s['quarantined']} (true {s['true']}) precision {s['precision']:.2f} "
                f"recall {s['recall']:.2f}  [{kinds}]  false: {s['false'][:5]}"
                if s
                else ""
            )
            + cost
        )
        if arm == "auto":
            print(
                f"         without screening, {len(injected) - s['true']}/{len(injected)} bad records never caused a flagged step"
            )
    clean_fp, runtimes, screen_s = [], {"screen": [], "auto": []}, []
    for k in range(a.clean_seeds):  # the arms alternate: screen, auto, screen, auto, ...
        for arm in ("screen", "auto"):
            r = run(clean, tmp / f"clean_{arm}_{k}", arm, a.seed + k, a.steps, base)
            runtimes[arm].append(r["runtime"])
            if arm == "screen":
                screen_s.append(r["screen_s"])
                clean_fp.append(len(r["entries"]))
                print(
                    f"clean seed {a.seed + k}: {len(r['entries'])} quarantined (screening on) "
                    f"{[(e['where'].rsplit('/', 1)[-1], e['reason']) for e in r['entries']][:5]}"
                )
    wall = sum(runtimes["screen"]) / sum(runtimes["auto"]) if sum(runtimes["auto"]) else float("nan")
    print(
        f"screen vs auto train runtime (clean file, {a.clean_seeds} seeds, alternating): {sum(runtimes['screen']):.1f}s vs "
        f"{sum(runtimes['auto']):.1f}s = {wall:.3f}x (whole-run wall time: run-to-run noise of a few %)"
    )
    # screening's own work, timed inside the callback (per-sample losses, gathers, suspects' re-runs), over the
    # screened runs' train time without it: the overhead without the noise of comparing separate runs
    work = sum(screen_s)
    overhead = sum(runtimes["screen"]) / (sum(runtimes["screen"]) - work) if runtimes["screen"] else float("nan")
    print(f"screening work {work:.2f}s in {sum(runtimes['screen']):.1f}s of training: overhead {overhead:.3f}x")
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
