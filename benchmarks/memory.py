"""Memory per token of a training step: the full-logits loss (the model's forward) vs hf_stable's chunked loss.

    python benchmarks/memory.py                                  # 128,256 and 151,936 vocabularies, 1024 / 3072 tokens
    python benchmarks/memory.py --vocabs 128256 --tokens 1024 4096 --reps 2 --arms full chunked trl

A random-init Llama (hidden 512, 4 layers, MLP 1536, 8 / 4 heads, untied head) with the default recipe's LoRA
(`hf_stable.modeling.apply_lora`: r 16 on every projection), fp32 as the CPU recipe, trained by `StableTrainer` for
`--steps` steps on packed rows of 512 tokens (position_ids restart per sample; each sample's first half is its
prompt, labels -100: half the tokens are supervised, as in SFT). Arms:

* ``full``: ``training_loss.chunked: false``, the model's forward (logits ``[tokens, vocab]`` kept for the backward);
* ``chunked``: the default, `hf_stable.loss` (the head over chunks of the supervised positions, recomputed in the
  backward), with ``--chunk-size`` rows per chunk (default 256: both token counts fill whole chunks, so the one
  chunk's logits held at a time are the same fixed cost in both and the slope is the per-token cost);
* ``trl``: TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`, what SFTTrainer 1.16 uses for its default
  ``nll`` loss) on the same model, batches and Trainer (called with ``fused_lm_head=True``).

Every (arm, vocabulary, tokens) runs in its own subprocess, arms alternating. Memory: the peak RSS of training alone
(the kernel's high-water mark, reset through /proc/self/clear_refs once the model, Trainer and batches exist, minus
the RSS at that point). MiB per token is the slope between the two token counts (what each computed token costs;
the fixed part - optimizer state, one chunk's logits - cancels). Step time: the median after the first step
(contended 2-core machine: compare arms, not absolute numbers).

Last lines: ``vocab=V mib_per_token full=F chunked=C ratio=R`` (and ``trl=T`` with that arm).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROW = 512
MIB = 1024**2


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rows(n_rows: int, vocab: int, seed: int = 0) -> list[dict]:
    """Packed rows of ROW tokens: samples of 64-192 tokens, each one's first half a prompt (labels -100)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        ids = torch.randint(0, vocab, (ROW,), generator=g)
        labels, pos, at = ids.clone(), torch.zeros(ROW, dtype=torch.long), 0
        while at < ROW:
            n = min(int(torch.randint(64, 193, (1,), generator=g)), ROW - at)
            pos[at : at + n] = torch.arange(n)
            labels[at : at + max(1, n // 2)] = -100
            at += n
        rows.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return rows


def run_arm(arm: str, vocab: int, tokens: int, steps: int, chunk: int) -> dict:
    import ctypes

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from hf_stable.config import load_config
    from hf_stable.config.loss import TrainingLossConfig
    from hf_stable.modeling import apply_lora
    from hf_stable.trainer import StableTrainer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=ROW,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    if arm == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)  # before peft, as its docstring asks
    model = apply_lora(model, load_config(check=False).lora, False)
    rows = _rows(tokens // ROW * steps, vocab)

    def collate(batch):
        out = {k: torch.stack([b[k] for b in batch]) for k in batch[0]}
        return {**out, "fused_lm_head": True} if arm == "trl" else out

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)

    args = TrainingArguments(
        output_dir=f"/tmp/hf_stable_memory_{os.getpid()}",
        per_device_train_batch_size=tokens // ROW,
        max_steps=steps,
        learning_rate=1e-4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    trainer = StableTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=collate,
        callbacks=[Clock()],
        training_loss=TrainingLossConfig(chunked=arm == "chunked", chunk_size=chunk),
    )
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _rss()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here: training's own peak
    trainer.train()
    peak = _peak() - before
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    step_s = statistics.median(times[1:] or times)
    return {"arm": arm, "vocab": vocab, "tokens": tokens, "peak_mib": peak / MIB, "step_s": step_s, "loss": losses[0]}


def _spawn(arm: str, vocab: int, tokens: int, steps: int, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--arm", arm, "--vocabs", str(vocab), "--tokens", str(tokens)]
    cmd += ["--steps", str(steps), "--chunk-size", str(chunk)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        raise SystemExit(f"{arm} {vocab} {tokens} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[-1][len("RESULT ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", type=int, nargs="+", default=[128256, 151936])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 3072], help="tokens per step (multiples of 512)")
    p.add_argument("--arms", nargs="+", default=["full", "chunked"], choices=["full", "chunked", "trl"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=256, help="chunked arm: supervised rows per chunk")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        print("RESULT " + json.dumps(run_arm(a.arm, a.vocabs[0], a.tokens[0], a.steps, a.chunk_size)), flush=True)
        return
    lo, hi = min(a.tokens), max(a.tokens)
    results: dict[tuple, list[dict]] = {}
    started = time.time()
    for rep in range(a.reps):
        for vocab in a.vocabs:
            for tokens in (lo, hi):
                arms = a.arms if rep % 2 == 0 else a.arms[::-1]  # alternate which arm runs first
                for arm in arms:
                    r = _spawn(arm, vocab, tokens, a.steps, a.chunk_size)
                    results.setdefault((arm, vocab, tokens), []).append(r)
                    print(
                        f"  {arm:8s} vocab={vocab} tokens={tokens} peak={r['peak_mib']:.0f} MiB "
                        f"step={r['step_s']:.2f} s first-step loss={r['loss']:.4f}",
                        flush=True,
                    )

    def med(arm, vocab, tokens, key):
        return statistics.median(r[key] for r in results[(arm, vocab, tokens)])

    print(f"\n| vocabulary | arm | peak MiB @ {lo} tok | peak MiB @ {hi} tok | MiB per token | step s @ {hi} tok |")
    print("|---|---|---|---|---|---|")
    summary = []
    for vocab in a.vocabs:
        slopes = {}
        for arm in a.arms:
            p_lo, p_hi = med(arm, vocab, lo, "peak_mib"), med(arm, vocab, hi, "peak_mib")
            slopes[arm] = (p_hi - p_lo) / (hi - lo)
            step = med(arm, vocab, hi, "step_s")
            print(f"| {vocab:,} | {arm} | {p_lo:.0f} | {p_hi:.0f} | {slopes[arm]:.3f} | {step:.2f} |")
        line = f"vocab={vocab} mib_per_token " + " ".join(f"{k}={v:.3f}" for k, v in slopes.items())
        if "full" in slopes and "chunked" in slopes:
            line += f" ratio={slopes['chunked'] / slopes['full']:.2f}"
            line += f" step_ratio={med('chunked', vocab, hi, 'step_s') / med('full', vocab, hi, 'step_s'):.2f}"
        summary.append(line)
    print(f"\n({time.time() - started:.0f} s)")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
