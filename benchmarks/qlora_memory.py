"""Peak memory and step time of bf16 LoRA vs 4-bit QLoRA vs QLoRA + 8-bit AdamW, next to the doctor's estimate.

    python benchmarks/qlora_memory.py                      # Llama-3.1-8B shape, 2 layers, seq 128, 3 steps, CPU
    python benchmarks/qlora_memory.py --layers 4 --reps 2

A reduced model of real shape (Llama-3.1-8B: hidden 4096, MLP 14336, 32/8 heads, vocabulary 128256, untied head;
only `--layers` decoder layers), random init, saved once in bf16 under `--cache`. Each arm runs in its own
subprocess (so each peak RSS is its own), arms alternating when `--reps` > 1. An arm loads the model the way the
recipe does (`hf_stable.modeling.load_model` + `apply_lora`: bitsandbytes quantization on load,
`prepare_model_for_kbit_training`, gradient checkpointing non-reentrant), builds the factory's optimizer and takes
`--steps` optimizer steps under bf16 autocast on random tokens. Memory: the process's peak RSS from just before the
model is trained (the kernel's high-water mark, reset through /proc/self/clear_refs once the model is loaded: loading
has its own transients, e.g. the bf16 checkpoint next to its fp32 upcast) minus the RSS of the bare process before
the model was loaded (Python, torch, bitsandbytes), next to `estimate_memory` for the loaded model. Step time is
the median after the first step (contended 2-core machine: compare arms, not absolute numbers).
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

ARMS = {
    "bf16 LoRA": {"quant": "none", "optim": "adamw"},
    "4-bit QLoRA": {"quant": "4bit", "optim": "adamw"},
    "QLoRA + paged 8-bit AdamW": {"quant": "4bit", "optim": "paged_adamw_8bit"},
}
GIB = 1024**3


def build_base(path: Path, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_since_reset() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_arm(arm: str, base: str, seq: int, batch: int, steps: int) -> dict:
    """One arm in this process: load, estimate, train; returns the numbers."""
    import ctypes

    import bitsandbytes  # noqa: F401  (every arm pays the same imports)
    import torch

    from hf_stable.config import load_config
    from hf_stable.doctor.memory_estimate import estimate_memory
    from hf_stable.doctor.settings import resolve_settings
    from hf_stable.modeling import apply_lora, load_model
    from hf_stable.optim import build_optimizer

    spec = ARMS[arm]
    argv = ["--model.name_or_path", base, "--model.dtype", "bfloat16", "--attention.implementation", "sdpa"]
    argv += ["--model.quantization.load_in", spec["quant"], "--optim.name", spec["optim"]]
    argv += ["--data.max_length", str(seq), "--training.per_device_train_batch_size", str(batch)]
    argv += ["--training.bf16", "true", "--training.activation_checkpointing", "true"]
    cfg = load_config(argv=argv, check=False)
    s = resolve_settings(cfg, None, remove_unused_columns=False)

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    bare = _rss()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    model = apply_lora(load_model(cfg, base), cfg.lora, True, quantization=cfg.model.quantization)
    model.train()
    with torch.no_grad():  # make every weight resident, as on a GPU: an mmap'd checkpoint is read only where used
        for p in model.parameters():
            p.view(-1)[:: max(1, 4096 // p.element_size())].sum()
    estimate = estimate_memory(model, cfg, s)
    optimizer = build_optimizer(model, cfg.optim, lr=2e-4, weight_decay=0.0)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    load_peak, loaded = _peak_since_reset() - bare, _rss() - bare
    Path("/proc/self/clear_refs").write_text("5")  # training's own peak from here (loading has its own transients)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    peak = _peak_since_reset() - bare
    return {
        "arm": arm,
        "peak_gib": peak / GIB,
        "loaded_gib": loaded / GIB,
        "load_peak_gib": load_peak / GIB,
        "estimate_gib": estimate.total / GIB,
        "largest": estimate.largest()[0],
        "estimate_parts": {k: round(v / GIB, 3) for k, v in estimate.parts.items()},
        "step_s": statistics.median(times[1:] or times),
        "loss": float(loss),
        "optimizer": type(optimizer).__name__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--cache", default=os.environ.get("HF_STABLE_BENCH_CACHE", "/tmp/hf_stable_bench"))
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        print("RESULT " + json.dumps(run_arm(a.arm, a.base, a.seq, a.batch, a.steps)))
        return

    base = build_base(Path(a.cache) / f"llama3.1-8b-shape-{a.layers}l", a.layers)
    rows = []
    for rep in range(a.reps):
        for arm in ARMS:
            cmd = [sys.executable, __file__, "--arm", arm, "--base", str(base)]
            cmd += ["--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"arm {arm!r} failed:\n{out.stderr[-3000:]}")
            row = json.loads(line[len("RESULT ") :])
            row["rep"] = rep
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\nLlama-3.1-8B shape, {a.layers} layers, batch {a.batch} x seq {a.seq}, {a.steps} steps, CPU\n")
    print(
        "| arm | optimizer | peak RSS (GiB) | doctor estimate (GiB) | estimate / peak | largest consumer | step (s) |"
    )
    print("|---|---|---:|---:|---:|---|---:|")
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        peak = statistics.median(r["peak_gib"] for r in mine)
        est = mine[0]["estimate_gib"]
        step = statistics.median(r["step_s"] for r in mine)
        print(
            f"| {arm} | {mine[0]['optimizer']} | {peak:.2f} | {est:.2f} | {est / peak:.2f} | {mine[0]['largest']} "
            f"| {step:.1f} |"
        )


if __name__ == "__main__":
    main()
