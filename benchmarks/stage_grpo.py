"""GRPO stage from the default SFT adapter: exact match per family before/after, reward over steps, KL, time.

    OMP_NUM_THREADS=1 python benchmarks/stage_grpo.py [--sft outputs/default] [--seeds 0,1,2] [--set KEY=VALUE ...]
    OMP_NUM_THREADS=1 python benchmarks/stage_grpo.py --headroom 16 [--temperature 1.0]   # what GRPO can reinforce
    OMP_NUM_THREADS=1 python benchmarks/stage_grpo.py --big-eval ...   # exact match on 567 held-out prompts, not 146

Each seed is one recipe run (`scripts/finetune.py --config configs/grpo.yaml --training.seed S`) started from the
same SFT output dir (made first with the default recipe when it is missing); `--set grpo.beta=0` and the like are
passed through as `--grpo.beta 0`. Prints one line per run, the per-family table over the seeds, and a last line:
`families_gained=N/3 mean_gain=... train_seconds=...` (a family counts as gained when its exact match after the
stage is above its exact match before in every seed... and on the mean).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("arithmetic", "reversal", "unit_conversion")


def run(args: list[str], log: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts/finetune.py"), *args],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=fh,
            check=False,
        )
    if proc.returncode != 0:
        sys.exit(f"run failed (exit {proc.returncode}): see {log}")


def headroom(sft: Path, k: int, temperature: float, n: int, overrides: list[str]) -> None:
    """What GRPO can reinforce from the SFT adapter: per family, greedy exact match, sampled exact match (k samples
    at `temperature`) and, among the prompts greedy gets wrong, the share with at least one right sample (pass@k)."""
    import torch

    from hf_stable.config import load_config
    from hf_stable.data.prompts import resolve_template, stop_token_ids
    from hf_stable.stages.grpo import _data, _encoder
    from hf_stable.stages.prompts import reference
    from hf_stable.stages.start import load_stage_model, resolve_start_from

    cfg = load_config(ROOT / "configs/grpo.yaml", ["--model.start_from", str(sft), *overrides])
    args = SimpleNamespace(gradient_checkpointing=False, seed=0)
    model, tok, _ = load_stage_model(cfg, args, resolve_start_from(str(sft)))
    model.eval()
    template = resolve_template(tok, cfg.data.template)
    stops = stop_token_ids(tok, template)
    encode = _encoder(tok, template)
    _, rows = _data(cfg, 0)
    torch.manual_seed(0)
    stats: dict[str, list] = {}
    for r in rows[:n]:
        if r["family"] not in FAMILIES:
            continue
        ids = torch.tensor([encode(r)])
        gen = {"max_new_tokens": 16, "eos_token_id": stops, "pad_token_id": tok.pad_token_id}
        with torch.no_grad():
            greedy = model.generate(ids, do_sample=False, **gen)
            samples = model.generate(
                ids.repeat(k, 1), do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **gen
            )

        def text(row, start=ids.shape[1]):
            row = row[start:].tolist()
            row = row[: next((i for i, t in enumerate(row) if t in stops), len(row))]
            return " ".join(tok.decode(row, skip_special_tokens=True).split())

        want = reference(r)
        g = text(greedy[0]) == want
        hits = sum(text(s_) == want for s_ in samples)
        stats.setdefault(r["family"], []).append((g, hits))
    for family, rs in sorted(stats.items()):
        wrong = [h for g, h in rs if not g]
        print(
            f"headroom family={family} n={len(rs)} greedy={sum(g for g, _ in rs) / len(rs):.3f} "
            f"sampled={sum(h for _, h in rs) / (k * len(rs)):.3f} "
            f"greedy_wrong_with_a_right_sample={sum(h > 0 for h in wrong)}/{len(wrong)} (k={k}, T={temperature})"
        )


def big_heldout(path: Path) -> int:
    """Write a held-out set larger than the SFT run's 200 prompts (where one prompt moves a family by 2-2.4 points):
    the arithmetic / reversal / unit conversion prompts of `embedded:eval`, then those of
    `scripts/make_dataset.py --n-eval 1200` (seed 0) that are in none of the shipped data files. Returns its size."""
    from hf_stable.embedded.tasks import instruction_dataset

    shipped = ROOT / "hf_stable/embedded/data"
    key = lambda r: (r.get("instruction"), r.get("input"))
    seen, first = set(), []
    for name in ("train", "grpo", "eval", "pairs_train", "pairs_eval"):
        for line in (shipped / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            seen.add(key(row))
            if name == "eval" and row.get("family") in FAMILIES:
                first.append(row)
    _, more = instruction_dataset(0, 2000, 1200)
    extra = []
    for row in more:
        if row.get("family") in FAMILIES and key(row) not in seen:
            seen.add(key(row))
            extra.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in first + extra)
    return len(first) + len(extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", default="outputs/default", help="the SFT run's output dir (made when missing)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    parser.add_argument("--out", default="outputs/bench_stage_grpo")
    parser.add_argument("--label", default="grpo")
    parser.add_argument("--headroom", type=int, default=0, metavar="K", help="only measure pass@K of the SFT adapter")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of --headroom")
    parser.add_argument(
        "--big-eval",
        action="store_true",
        help="exact match on the larger held-out set (`big_heldout`, written to OUT/heldout_big.jsonl)",
    )
    opts = parser.parse_args()
    overrides = []
    if opts.big_eval:
        path = ROOT / opts.out / "heldout_big.jsonl"
        n = big_heldout(path)
        overrides += ["--data.eval_file", str(path), "--evaluation.exact_match_samples", str(n)]
    for item in opts.set:
        key, _, value = item.partition("=")
        overrides += [f"--{key}", value]
    if opts.headroom:
        headroom(ROOT / opts.sft, opts.headroom, opts.temperature, 200, overrides)
        return
    out = ROOT / opts.out
    out.mkdir(parents=True, exist_ok=True)
    sft = ROOT / opts.sft
    if not (sft / "adapter_config.json").is_file():
        print(f"no SFT adapter in {sft}: running the default recipe first", flush=True)
        model_args = [
            a for i, a in enumerate(overrides) if a.startswith("--model.") or overrides[i - 1].startswith("--model.")
        ]
        run(["--training.output_dir", str(sft), *model_args], out / "sft.log")
    rows = []
    for seed in [int(s) for s in opts.seeds.split(",")]:
        run_dir = out / f"{opts.label}-seed{seed}"
        started = time.time()
        run(
            [
                "--config",
                str(ROOT / "configs/grpo.yaml"),
                "--model.start_from",
                str(sft),
                "--training.seed",
                str(seed),
                "--training.output_dir",
                str(run_dir),
                "--runtime.overwrite",
                "true",
                *overrides,
            ],
            out / f"{opts.label}-seed{seed}.log",
        )
        summary = json.loads((run_dir / "run_summary.json").read_text(encoding="utf-8"))
        state = json.loads((run_dir / "trainer_state.json").read_text(encoding="utf-8"))
        train_s = next((h["train_runtime"] for h in state["log_history"] if "train_runtime" in h), None)
        fam = summary["exact_match_by_family"]
        row = {
            "seed": seed,
            "before": fam["before"],
            "after": fam["after"],
            "reward_before": summary["reward_before"],
            "reward_after": summary["reward_after"],
            "kl_last": summary["kl_last"],
            "train_seconds": train_s,
            "wall_seconds": round(time.time() - started, 1),
            "steps": summary["train_steps"],
        }
        rows.append(row)
        cells = " ".join(f"{f}={row['before'][f]:.3f}->{row['after'][f]:.3f}" for f in FAMILIES)
        print(
            f"label={opts.label} seed={seed} {cells} reward={row['reward_before']}->{row['reward_after']} "
            f"kl_last={row['kl_last']:.4f} train_s={train_s} wall_s={row['wall_seconds']}",
            flush=True,
        )
    (out / f"{opts.label}.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    print("\n| family | before (mean) | after (mean) | after - before per seed |")
    print("|---|---|---|---|")
    gained, gains = 0, []
    for f in FAMILIES:
        deltas = [r["after"][f] - r["before"][f] for r in rows]
        before = statistics.mean(r["before"][f] for r in rows)
        after = statistics.mean(r["after"][f] for r in rows)
        gains.append(after - before)
        gained += int(all(d > 0 for d in deltas))
        print(f"| {f} | {before:.3f} | {after:.3f} | {', '.join(f'{d:+.3f}' for d in deltas)} |")
    train = statistics.mean(r["train_seconds"] for r in rows)
    print(
        f"\nlabel={opts.label} families_gained={gained}/{len(FAMILIES)} mean_gain={statistics.mean(gains):+.3f} "
        f"seeds={len(rows)} train_seconds={train:.0f}"
    )


if __name__ == "__main__":
    main()
