"""Cost of the replica-consistency check (`ReplicaCheck`) against a training step, on 2 gloo ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replica_check.py            # ~2 min on 2 CPU cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replica_check.py --steps 10 --repeats 50

Starts itself under `torchrun --standalone --nproc_per_node 2`. Two measurements:

1. The recipe's default model and LoRA (embedded tiny Llama: hidden 128, 4 layers; LoRA r 16 on all 7 projections:
   56 trainable tensors; batch 16 x 128 tokens per rank) in a stock `Trainer` under DDP with
   `ReplicaCheck(interval=1)`. A step's time is `on_step_begin` to `on_step_end` (a timer listed before the check, so
   the check is outside it); the check's time is its own (`ReplicaCheck.last_check_ms`: checksums, the all-gather,
   the verdict), taken after every step and then `--repeats` times on its own after training. Reported: the medians
   (the larger of the two ranks'), the share of the steps a check covers at the default interval, and the smallest
   interval that keeps it <= 0.5 %.
2. The check alone on a 7B-shaped LoRA (32 layers x 7 projections, r 16, hidden 4096, MLP 11008: 448 tensors, 40 M
   fp32 values), where no step can be timed on this machine: its time, and the step time at which the default
   interval's share is 0.5 %.

Last line: `replica_check_ms=<x> step_ms=<y> default_interval=<N> share=<p>% min_interval_for_0.5%=<k>
lora7b_check_ms=<z> lora7b_step_ms_for_0.5%=<s>`.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.005


def _worker(opts) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_stable.callbacks.monitors.replica_check import ReplicaCheck
    from hf_stable.config.stability import ReplicaCheckConfig
    from hf_stable.distributed import all_reduce_scalar, shutdown

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024, max_position_embeddings=256,
    )  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    rows = [
        {"input_ids": (ids := torch.randint(3, 1024, (128,), generator=g)), "labels": ids}
        for _ in range(16 * 2 * (opts.steps + 1))
    ]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append((time.perf_counter() - self._t) * 1e3)

    class CheckTimes(TrainerCallback):
        def __init__(self, check):
            self.check, self.times = check, []

        def on_step_end(self, args, state, control, **kw):
            self.times.append(self.check.last_check_ms)

    check = ReplicaCheck(interval=1)
    timer, check_times = StepTimer(), CheckTimes(check)
    args = TrainingArguments(
        output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=16, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, logging_steps=10**6,
        ddp_find_unused_parameters=False, learning_rate=1e-4,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[timer, check, check_times])
    trainer.train()
    assert not [e for e in check.events if e["kind"] == "replica_mismatch"], check.events
    alone = []
    for _ in range(opts.repeats):
        check.check(trainer.model, 0)
        alone.append(check.last_check_ms)

    def worst_median(xs: list[float]) -> float:  # skip the first (warm-up) step
        return all_reduce_scalar(statistics.median(xs[1:] if len(xs) > 2 else xs), "max")

    step_ms, in_run_ms, alone_ms = worst_median(timer.times), worst_median(check_times.times), worst_median(alone)

    # 2. a 7B-shaped LoRA: the check alone
    shapes = []
    for _ in range(32):
        for name, (d_in, d_out) in {
            "q": (4096, 4096), "k": (4096, 4096), "v": (4096, 4096), "o": (4096, 4096),
            "gate": (4096, 11008), "up": (4096, 11008), "down": (11008, 4096),
        }.items():  # fmt: skip
            shapes += [(f"{name}.lora_A", (16, d_in)), (f"{name}.lora_B", (d_out, 16))]
    big = torch.nn.Module()
    for i, (name, shape) in enumerate(shapes):
        big.register_parameter(f"p{i}_{name.replace('.', '_')}", torch.nn.Parameter(torch.randn(shape) * 0.01))
    n_values = sum(p.numel() for p in big.parameters())
    big_check = ReplicaCheck(ReplicaCheckConfig())
    times = []
    for _ in range(max(opts.repeats // 5, 5)):
        big_check.check(big, 0)
        times.append(big_check.last_check_ms)
    big_ms = worst_median(times)

    if dist.get_rank() == 0:
        interval = ReplicaCheckConfig().interval
        share = in_run_ms / (interval * step_ms)
        min_interval = math.ceil(max(in_run_ms, alone_ms) / (GOAL * step_ms))
        print(f"recipe default model, LoRA r16 x 7 projections: {len(check._params)} trainable tensors")
        print(f"  step (median, worse rank)            {step_ms:9.2f} ms")
        print(f"  check after each step (median)       {in_run_ms:9.3f} ms  = {in_run_ms / step_ms:.3%} of a step")
        print(f"  check alone, {opts.repeats} repeats (median)   {alone_ms:9.3f} ms")
        print(f"  default interval {interval}: {share:.4%} of the steps it covers (goal <= 0.5 %)")
        print(f"7B-shaped LoRA: {len(shapes)} tensors, {n_values / 1e6:.1f} M values: check {big_ms:.1f} ms")
        print(
            f"replica_check_ms={in_run_ms:.3f} step_ms={step_ms:.1f} default_interval={interval} share={share:.4%} "
            f"min_interval_for_0.5%={min_interval} lora7b_check_ms={big_ms:.1f} "
            f"lora7b_step_ms_for_0.5%={big_ms / (GOAL * interval):.0f}"
        )
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (each followed by a check)")
    parser.add_argument("--repeats", type=int, default=50, help="checks timed on their own after training")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        return _worker(opts)
    import tempfile

    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", __file__, *sys.argv[1:], "--out", out]
        raise SystemExit(subprocess.run(cmd, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
