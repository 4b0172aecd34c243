"""Specificity benchmark: do the default guards leave healthy training alone, at every batch size?

    OMP_NUM_THREADS=1 python benchmarks/specificity.py [--results FILE] [--label after] [--jobs 2]
        [--models lora,full] [--batches 1,2,4,16] [--packing on,off] [--seeds 3,4,5] [--steps 400]
        [--arms on,off[,null]] [--corner] [--faults] [--report-only]

Each run is the recipe as a user launches it (`scripts/finetune.py`, a subprocess, one torch thread): the embedded
default (LoRA on the tiny Llama) and a full fine-tune of `configs/tiny-qwen3.yaml` (`lora.enabled: false`), on the
clean embedded data, per-device batch x packing x seed, `max_steps` steps at an LR that is healthy for the batch
(`LRS`), guards on (the shipped defaults) vs `stability.guards.enabled: false`. Exact match is off (eval loss only);
every other setting is the recipe's. Counted from the run's `stability_events.jsonl`: skipped steps, rollbacks, LR
back-offs (a rollback's or the SNR guard's), and the eval loss from `run_summary.json`.

`--corner`: the too-high-LR corner (batch 1-2 at the recipe's 1e-3, LoRA), where the guards may act but must end
no worse than guards off on average. The runs there are chaotic, so `--arms on,off,null` adds a null control in the
corner: guards off with the Trainer's clip at 0.99999 instead of 1.0, a change of 1e-5 that is no policy at all;
its spread against the off arm is how far two equally good arms land apart, the yardstick for on/off.
`--faults`: batch 1, LoRA: a NaN forward at 3 steps (must be skipped) and a x1e3 burst (one decoder layer's MLP
output x1e3 for 3 steps, must end within 5 % of the clean run), injected by `specificity_faults.py` through the
recipe's own entry point.

Runs append to `--results` (JSON lines, one per run, keyed by label/arm/cell/seed) and are not re-run when present,
so one file can hold a `before` (an older checkout, `--label before`) and an `after` arm; the off arm is shared (the
guards' code does not run there). The report prints, per label, the pooled line and each cell:
skips and rollbacks per 1000 steps, LR back-offs, eval loss on / off (mean and worst).
Goal (issue 30): no rollback anywhere, <= 1 skip per 1000 clean steps pooled, on/off <= 1.03 every run, <= 1.01 mean.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from statistics import mean, median, stdev

ROOT = Path(__file__).resolve().parents[1]
# the LR a batch size trains healthily at: 2e-4 at batch 1-4, the recipe's 1e-3 (set for 16) at 16
LRS = {"lora": {1: 2e-4, 2: 2e-4, 4: 2e-4, 16: 1e-3}, "full": {1: 5e-5, 2: 5e-5, 4: 5e-5, 16: 2e-4}}
CORNER_LR = 1e-3
MODEL_ARGS = {"lora": [], "full": ["--config", "configs/tiny-qwen3.yaml", "--lora.enabled", "false"]}


NULL_CLIP = "0.99999"  # the null control's Trainer clip (guards off): 1e-5 away from the off arm's 1.0


def run_key(r: dict) -> str:
    arm = r["arm"] if r["arm"] in ("off", "null") else f"{r['label']}:on"
    return f"{arm}|{r['kind']}|{r['model']}|b{r['batch']}|p{r['packing']}|lr{r['lr']:g}|s{r['seed']}|n{r['steps']}"


def recipe_argv(spec: dict, out: str) -> list[str]:
    argv = [
        *MODEL_ARGS[spec["model"]],
        "--training.output_dir", out,
        "--training.per_device_train_batch_size", str(spec["batch"]),
        "--training.max_steps", str(spec["steps"]),
        "--training.learning_rate", str(spec["lr"]),
        "--training.seed", str(spec["seed"]),
        "--data.packing", "true" if spec["packing"] == "on" else "false",
        "--evaluation.exact_match_samples", "0",
        "--evaluation.before", "false",
    ]  # fmt: skip
    if spec["arm"] == "off":  # logged every step: the clean run's noise, for calibration (`series` in the results)
        argv += ["--stability.guards.enabled", "false", "--training.logging_steps", "1"]
    if spec["arm"] == "null":
        argv += ["--stability.guards.enabled", "false", "--training.max_grad_norm", NULL_CLIP]
    return argv


def run(spec: dict, tree: Path) -> dict:
    """One recipe run in a subprocess; the counts and the eval loss it wrote."""
    with tempfile.TemporaryDirectory(prefix="hfs-spec-") as tmp:
        out = str(Path(tmp) / "run")
        if spec["kind"] == "clean":
            cmd = [sys.executable, str(tree / "scripts" / "finetune.py"), *recipe_argv(spec, out)]
        else:
            cmd = [sys.executable, str(ROOT / "benchmarks" / "specificity_faults.py"), spec["kind"]]
            cmd += recipe_argv(spec, out)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree), "HF_STABLE_LOG_LEVEL": "WARNING"}
        proc = subprocess.run(cmd, check=False, cwd=tree, env=env, capture_output=True, text=True)
        result = {**spec, "rc": proc.returncode}
        summary = Path(out) / "run_summary.json"
        if proc.returncode != 0 or not summary.exists():
            result["error"] = (proc.stderr or proc.stdout)[-2000:]
            return result
        result["eval_loss"] = json.loads(summary.read_text())["eval_loss_after"]
        events_file = Path(out) / "stability_events.jsonl"  # absent when nothing was said
        lines = events_file.read_text().splitlines() if events_file.exists() else []
        events = [json.loads(line) for line in lines if line]
        kinds = [e.get("kind") for e in events]
        result["skips"] = kinds.count("step_skipped")
        result["rollbacks"] = kinds.count("rollback")
        result["declined"] = kinds.count("rollback_declined")
        result["backoffs"] = sum(1 for e in events if e.get("kind") in ("rollback", "lr_adjusted"))
        result["skip_reasons"] = [r for e in events if e.get("kind") == "step_skipped" for r in e.get("reasons", [])]
        result["nonfinite_skips"] = result["skip_reasons"].count("nonfinite")
        # what the run *said* (issue 41): warning/error events other than set-up notes, our console WARNING lines,
        # and the verdict; on a clean run every one must be zero / healthy
        from hf_stable.reporting.verdict import SETUP_KINDS

        said = [e for e in events if e.get("severity") in ("warning", "error") and e.get("kind") not in SETUP_KINDS]
        result["alert_kinds"] = sorted({e["kind"] for e in said})
        result["alerts"] = len(said)
        console = (proc.stdout + proc.stderr).splitlines()
        result["console_warnings"] = sum(
            1 for line in console if line.startswith(("[hf_stable] WARNING", "[hf_stable] ERROR"))
        )
        result["verdict"] = (json.loads(summary.read_text()).get("stability") or {}).get("verdict")
        state = json.loads((Path(out) / "trainer_state.json").read_text()) if spec["arm"] == "off" else None
        if state is not None:  # the clean run's per-step loss and grad norm: the noise the guards must tolerate
            hist = [h for h in state["log_history"] if "loss/train" in h]
            result["series"] = {
                "loss": [h.get("loss/train") for h in hist],
                "grad": [h.get("grad/norm_global") for h in hist],
            }
    return result


def cell(kind: str, model: str, batch: int, packing: str, lr: float, seed: int, arm: str, steps: int) -> dict:
    return {"kind": kind, "model": model, "batch": batch, "packing": packing, "lr": lr, "seed": seed, "arm": arm,
            "steps": steps}  # fmt: skip


def grid(a) -> list[dict]:
    specs = []
    for model in a.models:
        for batch in a.batches:
            for packing in a.packing:
                for seed in a.seeds:
                    for arm in (x for x in a.arms if x != "null"):  # the null control is for the corner
                        lr = LRS[model][batch]
                        specs.append(cell("clean", model, batch, packing, lr, seed, arm, a.steps))
    if a.corner:
        for batch in (1, 2):
            for seed in a.seeds:
                for arm in a.arms:
                    specs.append(cell("clean", "lora", batch, "on", CORNER_LR, seed, arm, a.steps))
    if a.faults:
        for kind in ("nan", "burst"):
            for seed in a.seeds:
                specs.append(cell(kind, "lora", 1, "on", 2e-4, seed, "on", a.steps))
    for s in specs:
        s["label"] = a.label if s["arm"] == "on" else s["arm"]
    return specs


def load(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {run_key(r): r for r in rows if "error" not in r}


def per_1000(n: int, steps: int) -> float:
    return 1000.0 * n / max(1, steps)


def report(results: dict[str, dict], label: str) -> None:
    on = {k: r for k, r in results.items() if r["arm"] == "on" and r["label"] == label and r["kind"] == "clean"}
    off = {run_key(r): r for r in results.values() if r["arm"] == "off"}
    cells: dict[tuple, list[tuple[dict, dict]]] = {}
    for r in on.values():
        twin = off.get(run_key({**r, "arm": "off", "label": "off"}))
        if twin is None:
            continue
        cells.setdefault((r["model"], r["batch"], r["packing"], r["lr"]), []).append((r, twin))
    print(f"\n== {label}: guards on (shipped defaults) vs off, clean runs ==")
    head = f"{'model':5} {'batch':>5} {'pack':>4} {'lr':>7} {'seeds':>5} {'skips/1k':>8} {'rollb':>5} {'backoff':>7}"
    print(f"{head} {'eval on/off per seed':>26} {'mean':>6} {'worst':>6}  skip reasons")
    pooled_steps = pooled_skips = pooled_rb = pooled_bo = 0
    healthy_ratios: list[float] = []
    corner_ratios: list[float] = []
    for key in sorted(cells):
        model, batch, packing, lr = key
        pairs = sorted(cells[key], key=lambda p: p[0]["seed"])
        steps = sum(r["steps"] for r, _ in pairs)
        skips = sum(r["skips"] for r, _ in pairs)
        rb = sum(r["rollbacks"] for r, _ in pairs)
        bo = sum(r["backoffs"] for r, _ in pairs)
        ratios = [r["eval_loss"] / t["eval_loss"] for r, t in pairs]
        reasons: dict[str, int] = {}
        for r, _ in pairs:
            for x in r["skip_reasons"]:
                reasons[x] = reasons.get(x, 0) + 1
        corner = lr == CORNER_LR and batch <= 2 and model == "lora"
        (corner_ratios if corner else healthy_ratios).extend(ratios)
        if not corner:
            pooled_steps, pooled_skips, pooled_rb, pooled_bo = (
                pooled_steps + steps,
                pooled_skips + skips,
                pooled_rb + rb,
                pooled_bo + bo,
            )
        per_seed = "/".join(f"{x:.3f}" for x in ratios)
        tag = " (too-high-LR corner)" if corner else ""
        print(
            f"{model:5} {batch:>5} {packing:>4} {lr:>7.0e} {len(pairs):>5} {per_1000(skips, steps):>8.2f} {rb:>5} "
            f"{bo:>7} {per_seed:>26} {mean(ratios):>6.3f} {max(ratios):>6.3f}  "
            f"{','.join(f'{k}:{v}' for k, v in sorted(reasons.items())) or '-'}{tag}"
        )
    faults = [r for r in results.values() if r["label"] == label and r["kind"] != "clean"]
    for r in sorted(faults, key=lambda r: (r["kind"], r["seed"])):
        twin = off.get(run_key({**r, "kind": "clean", "arm": "off", "label": "off"}))
        clean_on = on.get(run_key({**r, "kind": "clean"}))
        ref = clean_on or twin
        ratio = r["eval_loss"] / ref["eval_loss"] if ref else float("nan")
        print(
            f"fault={r['kind']} batch={r['batch']} seed={r['seed']} skips={r['skips']} "
            f"nonfinite_skips={r['nonfinite_skips']} rollbacks={r['rollbacks']} eval={r['eval_loss']:.4f} "
            f"vs_clean={ratio:.3f} events={','.join(r.get('alert_kinds', [])) or '-'} verdict={r.get('verdict')}"
        )
    said = [r for r in on.values() if r.get("alerts") or r.get("console_warnings")]
    said += [r for r in off.values() if r["label"] == label and (r.get("alerts") or r.get("console_warnings"))]
    clean = [r for r in [*on.values(), *off.values()] if r["kind"] == "clean" and "alerts" in r]
    print(
        f"clean runs that said something (warning/error events, console WARNING lines): {len(said)} of {len(clean)}"
        + "".join(
            f"\n  {run_key(r)}: {r['alerts']} events {','.join(r['alert_kinds'])}, {r['console_warnings']} lines, "
            f"verdict {r.get('verdict')}"
            for r in said
        )
    )
    if healthy_ratios:
        print(
            f"label={label} clean_steps={pooled_steps} skips_per_1000={per_1000(pooled_skips, pooled_steps):.2f} "
            f"rollbacks={pooled_rb} lr_backoffs={pooled_bo} eval_on_off_mean={mean(healthy_ratios):.4f} "
            f"eval_on_off_worst={max(healthy_ratios):.4f}"
            + (f" corner_on_off_mean={mean(corner_ratios):.4f}" if corner_ratios else "")
        )


def ratio_stats(ratios: list[float]) -> str:
    """n, mean, median, geometric mean, standard error, t of the mean log ratio, better / worse, worst."""
    logs = [math.log(x) for x in ratios]
    se = stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    t = mean(logs) / (stdev(logs) / len(logs) ** 0.5) if len(logs) > 1 and stdev(logs) > 0 else float("nan")
    return (
        f"n={len(ratios)} mean={mean(ratios):.4f} median={median(ratios):.4f} geomean={math.exp(mean(logs)):.4f} "
        f"se={se:.4f} t_log={t:.2f} better/worse={sum(x < 1 for x in ratios)}/{sum(x > 1 for x in ratios)} "
        f"worst={max(ratios):.3f}"
    )


def corner_report(results: dict[str, dict], label: str) -> None:
    """The corner's on/off ratios per batch and pooled, beside the null control's null/off (same seeds)."""
    rows: dict[str, list[float]] = {}
    for r in results.values():
        if r["arm"] != "off" or r["kind"] != "clean" or not (r["lr"] == CORNER_LR and r["batch"] <= 2):
            continue
        on = results.get(run_key({**r, "arm": "on", "label": label}))  # `results` is keyed by run_key (`load`)
        null = results.get(run_key({**r, "arm": "null", "label": "null"}))
        if on is None or null is None:  # only seeds with all three arms, so the two lines compare like with like
            continue
        for batch in (str(r["batch"]), "pooled"):
            rows.setdefault(f"on/off   batch {batch}", []).append(on["eval_loss"] / r["eval_loss"])
            rows.setdefault(f"null/off batch {batch}", []).append(null["eval_loss"] / r["eval_loss"])
    if rows:
        print(f"\n== {label}: too-high-LR corner, guards on vs off beside the null control (seeds with all arms) ==")
        for name in sorted(rows, key=lambda k: (k.split()[-1], k)):
            print(f"{name:>16}: {ratio_stats(rows[name])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="outputs/specificity.jsonl")
    p.add_argument("--label", default="after", help="name of the guards-on arm (the code in --tree)")
    p.add_argument("--tree", default=str(ROOT), help="the checkout whose scripts/finetune.py and hf_stable run")
    p.add_argument("--models", default="lora,full")
    p.add_argument("--batches", default="1,2,4,16")
    p.add_argument("--packing", default="on,off")
    p.add_argument("--seeds", default="3,4,5")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--arms", default="on,off")
    p.add_argument("--corner", action="store_true")
    p.add_argument("--faults", action="store_true")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    a.models, a.packing, a.arms = a.models.split(","), a.packing.split(","), a.arms.split(",")
    a.batches = [int(x) for x in a.batches.split(",")]
    a.seeds = [int(x) for x in a.seeds.split(",")]
    path = Path(a.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = load(path)
    if not a.report_only:
        todo = [s for s in grid(a) if run_key(s) not in done]
        # the slow cells (batch 16) first so the two workers end together
        todo.sort(key=lambda s: (-s["batch"], s["model"], s["seed"]))
        print(f"{len(todo)} runs to do ({len(done)} already in {path})", flush=True)
        with ThreadPoolExecutor(a.jobs) as pool:
            futures = [pool.submit(run, s, Path(a.tree)) for s in todo]
            for i, fut in enumerate(as_completed(futures), 1):
                try:
                    r = fut.result()
                except Exception as exc:  # noqa: BLE001 - one broken run must not lose the others' results
                    print(f"[{i}/{len(todo)}] failed: {exc!r}", flush=True)
                    continue
                with path.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                state = (
                    r.get("error", "")[-300:] or f"eval {r['eval_loss']:.4f} skips {r['skips']} rb {r['rollbacks']}"
                )
                print(f"[{i}/{len(todo)}] {run_key(r)}: {state}", flush=True)
        done = load(path)
    labels = sorted({r["label"] for r in done.values() if r["arm"] == "on"})
    for label in labels:
        report(done, label)
        corner_report(done, label)


if __name__ == "__main__":
    main()
