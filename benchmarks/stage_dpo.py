"""DPO stage benchmark: from the default SFT adapter, `configs/dpo.yaml` on the embedded pairs, per variant and seed.

    python benchmarks/stage_dpo.py [--sft outputs/default] [--variants shipped,sigmoid_lr2e-5,sigmoid_lr5e-4]
                                   [--seeds 0] [--exact-match 200]

Per run: the held-out preference accuracy (embedded:pairs_eval: pairs whose chosen answer gets the higher summed
log-probability) before and after, from the stage's run_summary.json; and what the stage costs the SFT task, measured
here on the SFT eval set (embedded:eval) with the SFT adapter and with the DPO adapter: the eval loss (token-weighted
NLL of the supervised answer tokens) and greedy exact match per family. Goal (issue 44): preference accuracy up, SFT
eval loss within +5 %. Variants are `--key value` overrides of configs/dpo.yaml; `shipped` is the file as it is.
Also TRL's reward accuracy after (``rewards/accuracies``: pairs whose implicit reward, the log-ratio to the SFT
reference, is higher for the chosen answer; 0 before training, where every reward is 0). Last lines:
``variant=... pref_acc=B->A reward_acc=0->A sft_eval_loss=B->A (+x%) exact_match=B->A``, one per variant (seed mean).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "shipped": [],  # configs/dpo.yaml: sigmoid + sft loss, LR 5e-4, 1 epoch
    "mixed_lr2e-5": ["--training.learning_rate", "2e-5"],
    "sigmoid_lr2e-5": ["--dpo.loss_type", "[sigmoid]", "--dpo.loss_weights", "null"],
    "sigmoid_lr5e-4": [
        "--dpo.loss_type",
        "[sigmoid]",
        "--dpo.loss_weights",
        "null",
        "--training.learning_rate",
        "5e-4",
    ],
    "mixed_lr5e-4": ["--training.learning_rate", "5e-4"],
    "sigmoid_lr1e-4": [
        "--dpo.loss_type",
        "[sigmoid]",
        "--dpo.loss_weights",
        "null",
        "--training.learning_rate",
        "1e-4",
    ],
    "mixed_lr1e-4": ["--training.learning_rate", "1e-4"],
    "mixed_lr3e-4_ep3": ["--training.learning_rate", "3e-4", "--training.num_train_epochs", "3"],
    "mixed_lr5e-4_sft2": ["--training.learning_rate", "5e-4", "--dpo.loss_weights", "[1.0, 2.0]"],
}


def sft_task_metrics(adapter_dir: Path, n_exact: int) -> dict:
    """SFT eval loss and exact match (overall and per family) of the default base + the adapter in `adapter_dir`."""
    import torch
    from peft import PeftModel

    from hf_stable.config import load_config
    from hf_stable.data import build_data, encode_prompt, reference_answer
    from hf_stable.evaluation import exact_match
    from hf_stable.modeling import load_model, load_tokenizer, resolve_base

    cfg = load_config(argv=[])
    base = resolve_base(cfg.model)
    tokenizer = load_tokenizer(cfg.model, base)
    model = PeftModel.from_pretrained(load_model(cfg, base), str(adapter_dir)).eval()
    data = build_data(cfg.data, tokenizer, seed=42)
    total = count = 0.0
    with torch.no_grad():
        rows = [data.eval_dataset[i] for i in range(len(data.eval_dataset))]
        for start in range(0, len(rows), 64):
            batch = data.eval_collator(
                [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows[start : start + 64]]
            )
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            labels = batch["labels"][:, 1:]
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
            )
            total += float(nll)
            count += int((labels != -100).sum())
    em = exact_match(
        model,
        tokenizer,
        data.eval_records[:n_exact],
        lambda r: encode_prompt(tokenizer, r, data.template),
        reference_answer,
        max_new_tokens=cfg.evaluation.max_new_tokens,
        stop_token_ids=data.stop_token_ids,
    )
    return {"eval_loss": total / count, "exact_match": em["exact_match"], "by_family": em["by_family"]}


def run_variant(name: str, seed: int, sft: Path, out_root: Path) -> dict:
    out = out_root / f"{name}-seed{seed}"
    args = ["--config", "configs/dpo.yaml", "--model.start_from", str(sft), "--training.seed", str(seed)]
    args += ["--training.output_dir", str(out), "--runtime.overwrite", "true", *VARIANTS[name]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "scripts/finetune.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    summary = json.loads((out / "run_summary.json").read_text())
    return {"out": out, "seconds": time.time() - t0, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", default="outputs/default", help="the default SFT run's output dir")
    parser.add_argument("--variants", default="shipped,sigmoid_lr2e-5,sigmoid_lr5e-4")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--exact-match", type=int, default=200, help="SFT eval prompts for exact match")
    parser.add_argument("--out", default="outputs/bench_stage_dpo")
    args = parser.parse_args()
    sft = (ROOT / args.sft).resolve()
    start = sft_task_metrics(sft, args.exact_match)
    print(
        f"SFT adapter {sft}: eval loss {start['eval_loss']:.4f}, exact match {start['exact_match']:.3f} "
        f"{json.dumps(start['by_family'])}",
        flush=True,
    )
    lines = []
    for name in args.variants.split(","):
        rows = []
        for seed in (int(s) for s in args.seeds.split(",")):
            run = run_variant(name, seed, sft, ROOT / args.out)
            pref = run["summary"]["preference"]
            after = sft_task_metrics(run["out"], args.exact_match)
            rows.append((pref["before"]["preference_accuracy"], pref["after"]["preference_accuracy"], after, run))
            print(
                f"{name} seed {seed}: {run['summary']['train_steps']} steps, {run['summary']['train_seconds']:.0f}s "
                f"training; pref acc {rows[-1][0]:.3f} -> {rows[-1][1]:.3f}; reward acc (TRL, vs the SFT reference) "
                f"{pref['after'].get('rewards/accuracies', float('nan')):.3f}, margin "
                f"{pref['after'].get('rewards/margins', float('nan')):.3f}; chosen logp/token "
                f"{pref['before']['chosen_logp_per_token']:.3f} -> {pref['after']['chosen_logp_per_token']:.3f}; "
                f"SFT eval loss {start['eval_loss']:.4f} -> {after['eval_loss']:.4f}; exact match "
                f"{start['exact_match']:.3f} -> {after['exact_match']:.3f} {json.dumps(after['by_family'])}",
                flush=True,
            )
        n = len(rows)
        b, a = sum(r[0] for r in rows) / n, sum(r[1] for r in rows) / n
        loss = sum(r[2]["eval_loss"] for r in rows) / n
        em = sum(r[2]["exact_match"] for r in rows) / n
        reward_acc = sum(r[3]["summary"]["preference"]["after"].get("rewards/accuracies", 0.0) for r in rows) / n
        change = loss / start["eval_loss"] - 1
        lines.append(
            f"variant={name} seeds={n} pref_acc={b:.3f}->{a:.3f} reward_acc=0->{reward_acc:.3f} sft_eval_loss={start['eval_loss']:.4f}->{loss:.4f} "
            f"({change:+.1%}) exact_match={start['exact_match']:.3f}->{em:.3f}"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
