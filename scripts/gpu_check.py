"""One prepared check of the `hf_stable` attention on a CUDA machine; prints a single report.

    python scripts/gpu_check.py            # < 5 minutes on one modern GPU

What it checks (bf16 throughout):
  1. training steps (AdamW) of two identical Llama-style models, stock `sdpa` vs `hf_stable` (which must pick
     flash-attn 2), on a right-padded batch and on a packed batch (position_ids restarting + cu_seq_lens):
     losses, logits and gradients must agree within bf16 tolerance; peak memory of each;
  2. flash-attn's native soft-cap against the explicit fp32 path;
  3. the benchmark ratios (`benchmarks/attention.py`) on the GPU;
  4. the monitor benchmark (`benchmarks/monitor_overhead.py --device cuda`): `monitor_overhead=` and
     `naive_vs_ours=` where each naive `.item()` really stalls the stream (runs without flash-attn too).
Without CUDA it prints why, then "skipped", and exits 0; without flash-attn only check 4 runs. Exit 1 when a check
fails.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_STABLE_LOG_LEVEL", "WARNING")
REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 270.0  # leave headroom under the 5-minute limit
START = time.monotonic()


def skip(reason: str) -> int:
    print(f"gpu_check: {reason}")
    print("gpu_check: skipped")
    return 0


def left() -> float:
    return BUDGET_S - (time.monotonic() - START)


class Report:
    def __init__(self):
        self.lines: list[str] = []
        self.failed: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.add(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")
        if not ok:
            self.failed.append(name)


def build(attn: str, torch, hidden=1024, layers=8, heads=16, kv=4):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16).cuda().train()


def batches(torch, batch=8, seq=1024):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 8192, (batch, seq), generator=gen)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    am = (torch.arange(seq)[None] < lengths[:, None]).long()
    padded = {"input_ids": ids, "attention_mask": am, "labels": ids.masked_fill(am == 0, -100)}
    flat = torch.cat([ids[b, : lengths[b]] for b in range(batch)])[None]
    pos = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    labels = flat.clone()
    labels[0, cu[:-1].long()] = -100
    packed = {
        "input_ids": flat,
        "position_ids": pos,
        "labels": labels,
        "use_cache": False,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
    }
    move = lambda d: {k: v.cuda() if hasattr(v, "cuda") else v for k, v in d.items()}
    return move(padded), move(packed)


def train_steps(model, batch, steps, torch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, first_logits, first_grads = [], None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(steps):
        if i == 1:  # time steps 2.. (step 1 pays for kernel selection and allocator growth)
            torch.cuda.synchronize()
            start = time.perf_counter()
        out = model(**batch)
        out.loss.backward()
        if i == 0:
            first_logits = out.logits.detach().float()
            first_grads = torch.cat([p.grad.detach().float().flatten() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    torch.cuda.synchronize()
    return {
        "losses": losses,
        "logits": first_logits,
        "grads": first_grads,
        "s_per_step": (time.perf_counter() - start) / max(1, steps - 1),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def compare_backends(report: Report, torch, name: str, batch: dict, steps: int) -> None:
    from hf_stable.attention import backend_usage, reset_backend_usage

    results = {}
    for attn in ("sdpa", "hf_stable"):
        model = build(attn, torch)
        reset_backend_usage()
        results[attn] = train_steps(model, batch, steps, torch)
        if attn == "hf_stable":
            results[attn]["usage"] = backend_usage()
        del model
        torch.cuda.empty_cache()
    a, b = results["sdpa"], results["hf_stable"]
    report.add(f"{name}: {steps} bf16 AdamW steps; backends used by hf_stable: {b['usage']}")
    report.check(f"{name} flash ran", set(b["usage"]) == {"flash"}, f"{b['usage']}")
    rows = batch["labels"] != -100
    dl = (a["logits"][rows] - b["logits"][rows]).abs()
    report.check(
        f"{name} logits (step 1)",
        dl.mean().item() < 2e-2,
        f"mean |diff| {dl.mean().item():.2e}, max {dl.max().item():.2e}",
    )
    cos = torch.nn.functional.cosine_similarity(a["grads"].double(), b["grads"].double(), dim=0).item()
    report.check(f"{name} gradients (step 1)", cos > 0.99, f"cosine {cos:.5f}")
    rel = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"], strict=False))
    report.check(
        f"{name} losses",
        rel < 2e-2,
        f"max rel diff {rel:.2e} over {steps} steps "
        f"(sdpa {a['losses'][0]:.4f}->{a['losses'][-1]:.4f}, hf_stable {b['losses'][0]:.4f}->"
        f"{b['losses'][-1]:.4f})",
    )
    report.add(
        f"  peak memory: sdpa {a['peak_gib']:.2f} GiB, hf_stable {b['peak_gib']:.2f} GiB; "
        f"time/step: sdpa {a['s_per_step'] * 1e3:.1f} ms, hf_stable {b['s_per_step'] * 1e3:.1f} ms"
    )


def softcap_check(report: Report, torch) -> None:
    import types

    from hf_stable.attention import AttentionSettings, hf_stable_attention_forward, use_settings
    from hf_stable.attention.kernels import flash_supports_softcap

    if not flash_supports_softcap():
        report.add("softcap: installed flash-attn has no softcap argument; explicit path is used instead")
        return
    torch.manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=4, is_causal=True, training=False, layer_idx=0)
    q = (torch.randn(2, 16, 512, 64, device="cuda") * 4).bfloat16()
    k = (torch.randn(2, 4, 512, 64, device="cuda") * 4).bfloat16()
    v = torch.randn(2, 4, 512, 64, device="cuda").bfloat16()
    with use_settings(AttentionSettings(softcap=30.0)):
        flash, _ = hf_stable_attention_forward(module, q, k, v, None, scaling=0.125)
    with use_settings(AttentionSettings(softcap=30.0, backend="eager")):
        explicit, _ = hf_stable_attention_forward(module, q, k, v, None, scaling=0.125)
    diff = (flash.float() - explicit.float()).abs()
    scale = explicit.float().abs().max().item()
    ok = diff.mean().item() < 5e-3 and diff.max().item() < 2e-2 * scale + 1e-2  # both rounded to bf16
    report.check(
        "softcap flash vs explicit fp32",
        ok,
        f"mean |diff| {diff.mean().item():.2e}, max {diff.max().item():.2e} (max |out| {scale:.2f})",
    )


def monitor_benchmark() -> None:
    """Check 4: the monitor cost on the GPU (about a minute), its summary lines printed as they come."""
    import contextlib
    import io

    spec = importlib.util.spec_from_file_location("bench_monitors", REPO / "benchmarks" / "monitor_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    out = io.StringIO()
    try:
        spec.loader.exec_module(bench)
        with contextlib.redirect_stdout(out):
            bench.main(["--rounds", "3", "--device", "cuda"])
    except Exception as e:  # a benchmark failure must not hide the attention checks
        print(f"monitor benchmark: failed ({type(e).__name__}: {e})", flush=True)
    for line in out.getvalue().splitlines():
        if not line.startswith("ratio:"):
            print(f"monitor benchmark: {line}", flush=True)


def main() -> int:
    try:
        import torch
    except ImportError:
        return skip("torch is not installed")
    if not torch.cuda.is_available():
        return skip("no CUDA device visible (torch.cuda.is_available() is False)")
    sys.path.insert(0, str(REPO))
    monitor_benchmark()
    try:
        import flash_attn
    except ImportError as e:
        return skip(f'flash-attn is not importable ({e}); install it with: pip install "hf-stable[flash]"')

    from hf_stable.attention import AttentionSettings, register

    register(AttentionSettings())
    report = Report()
    import transformers

    report.add(
        f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, flash-attn {getattr(flash_attn, '__version__', '?')}"
    )
    padded, packed = batches(torch)
    for name, batch in (("padded batch", padded), ("packed batch", packed)):
        if left() < 120:
            report.add(f"{name}: skipped, time budget")
            continue
        compare_backends(report, torch, name, batch, steps=10)
    softcap_check(report, torch)
    if left() > 60:
        spec = importlib.util.spec_from_file_location("bench_attention", REPO / "benchmarks" / "attention.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        for seq in (256, 2048):
            if left() < 40:
                break
            out = bench.measure("cuda", torch.bfloat16, rounds=20, batch=8, seq=seq, verbose=False)
            report.add(
                f"benchmark (bf16, batch 8, seq {seq}): attn_ratio_off={out['attn_ratio_off']:.3f} "
                f"attn_ratio_on={out['attn_ratio_on']:.3f} (sampled step x{out['sampled_step_ratio']:.3f})"
            )
    else:
        report.add("benchmark: skipped, time budget")
    status = "FAILED: " + ", ".join(report.failed) if report.failed else "all checks passed"
    report.add(f"gpu_check: {status} in {time.monotonic() - START:.0f} s")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
