"""Forward+backward time: stock `sdpa` vs `hf_stable` (monitor off, then on at its default interval).

    .venv/bin/python benchmarks/attention.py            # CPU, ~1 min
    .venv/bin/python benchmarks/attention.py --device cuda --dtype bfloat16

A tiny-but-not-trivial Llama (hidden 256, 4 layers, 4 heads / 2 KV heads, seq 256, batch 8, right-padded to
realistic SFT lengths). Variants share weights and batch and run interleaved, one forward+backward each per
round in a rotating order, so drift in machine load hits all of them alike; medians over rounds are
compared. "Monitor on" is the callback's schedule at its default interval: one sampled step (probe armed,
read back once) per `interval` steps. Last line: `attn_ratio_off=<x> attn_ratio_on=<y>` (goals: <= 1.05,
<= 1.10).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_stable.attention import AttentionSettings, get_probe, register
from hf_stable.config import AttentionConfig

logging.getLogger("hf_stable").setLevel(logging.WARNING)  # no "backend chosen" lines inside the timing output
DEFAULT_INTERVAL = AttentionConfig().monitor_interval


def build(attn: str, device, dtype, seed: int = 0, hidden: int = 256, layers: int = 4):
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(device=device, dtype=dtype).train()


def make_batch(batch: int, seq: int, device, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1024, (batch, seq), generator=gen)
    lengths = torch.randint(seq * 3 // 4, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    am = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(am == 0, -100)
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": am, "labels": labels}.items()}


def step(model, batch) -> None:
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_step(model, batch, device, sampled: bool) -> float:
    """Seconds for one training step; a sampled step arms the probe and reads it back once, like the callback."""
    probe = get_probe()
    sync(device)
    start = time.perf_counter()
    if sampled:
        probe.arm(step=0)
    step(model, batch)
    if sampled:
        probe.disarm()
        probe.layer_maxima()  # the single device->host read of the sample
    sync(device)
    elapsed = time.perf_counter() - start
    probe.reset()
    return elapsed


def measure(
    device="cpu",
    dtype=torch.float32,
    rounds: int = 15,
    interval: int = DEFAULT_INTERVAL,
    batch: int = 8,
    seq: int = 256,
    hidden: int = 256,
    layers: int = 4,
    verbose: bool = True,
) -> dict:
    """Median step times and the two ratios. "Monitor on" = one sampled step per `interval` steps:
    `(sampled + (interval - 1) * unsampled) / interval`, the exact cost of the callback's schedule."""
    register(AttentionSettings())
    models = {
        "sdpa": build("sdpa", device, dtype, hidden=hidden, layers=layers),
        "hf_stable": build("hf_stable", device, dtype, hidden=hidden, layers=layers),
    }
    data = make_batch(batch, seq, device)
    variants = {"sdpa": ("sdpa", False), "hf_stable": ("hf_stable", False), "hf_stable sampled": ("hf_stable", True)}
    for model, sampled in variants.values():  # warm-up: allocator, kernels, first-call logging
        timed_step(models[model], data, device, sampled)
    times: dict[str, list[float]] = {n: [] for n in variants}
    names = list(variants)
    for r in range(rounds):  # interleaved, rotating order: load drift hits every variant alike
        for name in names[r % 3 :] + names[: r % 3]:
            model, sampled = variants[name]
            times[name].append(timed_step(models[model], data, device, sampled))
    med = {n: statistics.median(v) for n, v in times.items()}
    on_step = (med["hf_stable sampled"] + (interval - 1) * med["hf_stable"]) / interval
    off = med["hf_stable"] / med["sdpa"]
    on = on_step / med["sdpa"]
    if verbose:
        print(
            f"device={device} dtype={str(dtype).replace('torch.', '')} batch={batch} seq={seq} hidden={hidden} "
            f"layers={layers} rounds={rounds} threads={torch.get_num_threads()} monitor interval={interval}"
        )
        rows = [
            ("sdpa (stock)", med["sdpa"]),
            ("hf_stable, monitor off", med["hf_stable"]),
            ("hf_stable, sampled step", med["hf_stable sampled"]),
            (f"hf_stable, monitor on (1 in {interval})", on_step),
        ]
        for label, t in rows:
            print(f"  {label:<34} {t * 1e3:9.2f} ms/step   x{t / med['sdpa']:.3f}")
    return {
        "median_s": med,
        "attn_ratio_off": off,
        "attn_ratio_on": on,
        "sampled_step_ratio": med["hf_stable sampled"] / med["sdpa"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (1 by default: on a shared machine, more threads mostly measure contention)",
    )
    parser.add_argument("--interval", type=int, default=DEFAULT_INTERVAL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = measure(args.device, getattr(torch, args.dtype), args.rounds, args.interval, args.batch, args.seq)
    print(f"attn_ratio_off={out['attn_ratio_off']:.3f} attn_ratio_on={out['attn_ratio_on']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
