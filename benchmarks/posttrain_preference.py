"""Preference benchmark (issue 40): TRL's DPOTrainer on the tiny LoRA Llama (CPU), a clean run under `stabilize`
and a burst of swapped pairs, stock TRL vs `stabilize`.

    OMP_NUM_THREADS=1 python benchmarks/posttrain_preference.py [--seeds 0,1,2] [--steps 64] [--burst 40,41]

Per seed (64 steps, batch 4, LR 1e-2, beta 1, sequential order, so a healthy run reaches reward accuracy 1):

* ``clean`` under `stabilize`: warnings after setup (any hf_stable event of severity warning/error at a step > 0,
  the preference rules included), skipped steps, final reward accuracy and margin (TRL's ``rewards/accuracies`` /
  ``rewards/margins``, mean of the last 5 steps);
* ``burst``: the batches of the `--burst` steps with chosen and rejected swapped (4 pairs each), stock TRL and
  `stabilize` (records read from a JSONL file): the steps skipped, whether the `step_pairs` events name exactly the
  swapped pairs by file:line, and the final reward accuracy / margin against the clean run's.

The tiny policy and the data come from `tests/dist_scripts/posttrain_common.py` (the tests' own).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dist_scripts"))

from posttrain_common import all_finite, build_trainer, preference_rows, quiet, trainable

import hf_stable
from hf_stable.core.events import read_events

BATCH = 4


def _last(trainer, key: str, n: int = 5) -> float:
    vals = [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h][-n:]
    return sum(vals) / max(1, len(vals))


def run(seed: int, steps: int, burst: list[int], arm: str, tmp: Path) -> dict:
    """One DPO run: arm ``clean`` (stabilize), ``stock`` or ``stabilize`` (both with the swapped burst)."""
    rows = preference_rows(BATCH * steps, seed=seed)
    swapped = []
    if arm != "clean":
        for step in burst:
            for i in range(BATCH * (step - 1), BATCH * step):
                rows[i]["chosen"], rows[i]["rejected"] = rows[i]["rejected"], rows[i]["chosen"]
                swapped.append(i)
    out = tmp / f"{arm}-{seed}"
    out.mkdir(parents=True)
    path = out / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    trainer = build_trainer(
        "dpo",
        out,
        seed=seed,
        data=rows,
        max_steps=steps,
        learning_rate=1e-2,
        beta=1.0,
        train_sampling_strategy="sequential",
    )
    if arm != "stock":
        hf_stable.stabilize(trainer, records=path)
    quiet(trainer.train)
    events = read_events(out) if (out / "stability_events.jsonl").exists() else []
    named = sorted(i for e in events if e["kind"] == "step_pairs" for i in e["records"])
    where = sorted(w for e in events if e["kind"] == "step_pairs" for w in (e.get("where") or []))
    return {
        "seed": seed,
        "arm": arm,
        "warnings": [
            f"{e['step']}:{e['kind']}" for e in events if e["step"] > 0 and e.get("severity") in ("warning", "error")
        ],
        "skipped": [e["step"] for e in events if e["kind"] == "step_skipped"],
        "pairs_named": bool(swapped) and named == swapped and where == sorted(f"pairs.jsonl:{i + 1}" for i in swapped),
        "pairs_extra": sorted(set(named) - set(swapped)),
        "finite": all_finite(trainable(trainer.model)),
        "accuracy": _last(trainer, "rewards/accuracies"),
        "margin": _last(trainer, "rewards/margins"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--burst", default="40,41", help="1-based steps whose batch has chosen/rejected swapped")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    burst = [int(s) for s in args.burst.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for arm in ("clean", "stock", "stabilize"):
                r = run(seed, args.steps, burst, arm, Path(tmp))
                print(json.dumps(r), flush=True)
                results.append(r)
    by = {(r["seed"], r["arm"]): r for r in results}
    print(
        f"\nDPO, {args.steps} steps, swapped batches at steps {burst} ({BATCH} pairs each)\n"
        "\n| seed | clean (stabilize): warnings / skipped / accuracy / margin | stock + burst: accuracy / margin "
        "| stabilize + burst: skipped / pairs named (file:line) / accuracy / margin |\n|---|---|---|---|"
    )
    for seed in seeds:
        c, s, h = by[(seed, "clean")], by[(seed, "stock")], by[(seed, "stabilize")]
        print(
            f"| {seed} | {len(c['warnings'])} / {len(c['skipped'])} / {c['accuracy']:.3f} / {c['margin']:.3f} "
            f"| {s['accuracy']:.3f} / {s['margin']:.3f} "
            f"| {h['skipped']} / {'yes' if h['pairs_named'] else 'NO'} / {h['accuracy']:.3f} / {h['margin']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
