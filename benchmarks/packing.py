"""Padded vs packed training throughput, and collator speed against transformers and TRL.

    python benchmarks/packing.py [--arch llama] [--batch-size 8] [--steps 24] [--clock cpu|wall] [--threads N]

On an alpaca-like length mix (short prompts, log-normal answer lengths with a long tail) this trains
the embedded tiny base architecture (random init, sizes from `EmbeddedBaseConfig`) for the same
batches twice — right-padded (`PaddingCollator`) and padding-free packed (`PackingCollator`) — and
reports *real* (non-padding) tokens per second of forward + backward + AdamW step. It then times the
collators alone in samples/s: ours (padded) vs transformers' `DataCollatorForSeq2Seq`, and ours
(packed) vs TRL's `DataCollatorForLanguageModeling(padding_free=True)`.

The last line is machine-readable:
    packed_vs_padded_speedup=<x> collator_vs_hf=<y> collator_vs_trl=<z>
Compare ratios from the same run only. ``--clock cpu`` (default) times with the process's CPU time and one
torch thread, so other jobs on a shared machine do not distort the ratios; ``--clock wall`` measures
wall-clock time with torch's default threads.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def alpaca_like_records(n: int, seed: int) -> list[dict]:
    """Instruction records whose token lengths follow the shape of the Alpaca set: most short, a long tail."""
    from hf_stable.embedded.tasks import EN_WORDS, sample

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ex = sample(rng)
        # ~2.5 tokens per word with the tiny BPE: total tokens median ~90, p95 ~300, as Alpaca with a Llama tokenizer
        n_in = min(60, int(rng.lognormvariate(math.log(3), 1.0)))
        n_out = max(1, min(200, int(rng.lognormvariate(math.log(16), 1.0))))
        extra = " ".join(rng.choice(EN_WORDS) for _ in range(n_in))
        answer = " ".join(rng.choice(EN_WORDS) for _ in range(n_out))
        rows.append({"instruction": ex["instruction"], "input": extra, "output": f"{ex['output']} {answer}"})
    return rows


def build(arch: str, n_samples: int, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_stable.config import EmbeddedBaseConfig
    from hf_stable.data import encode_records
    from hf_stable.data.records import Record
    from hf_stable.embedded.builder import tiny_model_config
    from hf_stable.embedded.tasks import pretraining_corpus
    from hf_stable.embedded.tokenizer import train_tokenizer

    base = EmbeddedBaseConfig(pretrain_steps=0)
    tok = train_tokenizer(pretraining_corpus(seed, n_lines=2000), vocab_size=base.vocab_size)
    rows = alpaca_like_records(n_samples, seed)
    recs = [Record(r, "alpaca_like.jsonl", i + 1) for i, r in enumerate(rows)]
    samples, _ = encode_records(tok, recs, max_length=base.max_position_embeddings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_model_config(arch, base, tok), attn_implementation="sdpa")
    return tok, model, samples


CLOCK = time.process_time


def train_throughput(model, batches, collator, warmup: int = 2) -> tuple[float, float]:
    """Real tokens/s and mean padding fraction of a forward+backward+AdamW loop over `batches`."""
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    real = total = 0
    elapsed = 0.0
    for i, feats in enumerate(batches):
        t0 = CLOCK()
        batch = collator(feats)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = CLOCK() - t0
        if i >= warmup:
            elapsed += dt
            real += sum(len(f["input_ids"]) for f in feats)
            total += batch["input_ids"].numel()
    return real / elapsed, 1 - real / total


def collator_speed(collator, batches, repeat: int) -> float:
    t0 = CLOCK()
    n = 0
    for _ in range(repeat):
        for feats in batches:
            collator(feats)
            n += len(feats)
    return n / (CLOCK() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=24, help="timed training steps per mode (after 2 warm-up steps)")
    p.add_argument("--collator-samples", type=int, default=4000, help="samples collated per collator")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="process CPU time (1 thread) or wall")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: 1 with --clock cpu, else default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch
    from transformers import DataCollatorForSeq2Seq
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_stable.data import PackingCollator, PaddingCollator

    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads or args.clock == "cpu":
        torch.set_num_threads(args.threads or 1)
    bs = args.batch_size
    n_train = (args.steps + 2) * bs
    tok, model, samples = build(args.arch, max(n_train, 512), args.seed)
    max_len = model.config.max_position_embeddings
    lengths = sorted(len(s["input_ids"]) for s in samples)
    print(
        f"{len(samples)} alpaca-like samples, tokens min/median/p95/max = {lengths[0]}/{lengths[len(lengths) // 2]}/"
        f"{lengths[int(0.95 * len(lengths))]}/{lengths[-1]}; {args.arch} "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; torch threads {torch.get_num_threads()}; "
        f"{args.clock} clock"
    )
    rng = random.Random(args.seed)
    order = list(range(len(samples)))
    rng.shuffle(order)
    batches = [[samples[i] for i in order[k : k + bs]] for k in range(0, n_train, bs)]

    init = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {
        "padded (PaddingCollator)": PaddingCollator(tok.pad_token_id),
        f"packed, rows <= {max_len} tokens (default)": PackingCollator(tok.pad_token_id, max_row_tokens=max_len),
        "packed, one row per batch": PackingCollator(tok.pad_token_id),
    }
    results = {}
    for name, collator in modes.items():
        model.load_state_dict(init)
        results[name] = train_throughput(model, batches, collator)
    padded_tps = results["padded (PaddingCollator)"][0]
    speedup = results[f"packed, rows <= {max_len} tokens (default)"][0] / padded_tps
    print(f"\ntraining, batch {bs}, {args.steps} timed steps each      real tokens/s   padding   vs padded")
    for name, (tps, frac) in results.items():
        print(f"  {name:<42} {tps:>10.0f}   {frac:>6.1%}   {tps / padded_tps:>8.2f}x")

    feats = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]
    cbatches = [feats[k : k + bs] for k in range(0, len(feats) - bs + 1, bs)]
    repeat = max(1, args.collator_samples // (len(cbatches) * bs))
    speeds = {
        "ours padded (PaddingCollator)": collator_speed(PaddingCollator(tok.pad_token_id), cbatches, repeat),
        "transformers DataCollatorForSeq2Seq": collator_speed(
            DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100), cbatches, repeat
        ),
        "ours packed (PackingCollator)": collator_speed(PackingCollator(tok.pad_token_id), cbatches, repeat),
        "TRL DataCollatorForLanguageModeling(padding_free)": collator_speed(
            DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id, padding_free=True), cbatches, repeat
        ),
    }
    print(f"\ncollators, batch {bs}, {repeat * len(cbatches) * bs} samples each        samples/s")
    for name, sps in speeds.items():
        print(f"  {name:<50} {sps:>10.0f}")
    vs_hf = speeds["ours padded (PaddingCollator)"] / speeds["transformers DataCollatorForSeq2Seq"]
    vs_trl = speeds["ours packed (PackingCollator)"] / speeds["TRL DataCollatorForLanguageModeling(padding_free)"]
    print(f"  ours padded / transformers = {vs_hf:.2f}x; ours packed / TRL padding-free = {vs_trl:.2f}x\n")
    print(f"packed_vs_padded_speedup={speedup:.2f} collator_vs_hf={vs_hf:.2f} collator_vs_trl={vs_trl:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
