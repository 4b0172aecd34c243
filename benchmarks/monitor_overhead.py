"""Cost of the stability monitors: Trainer step time with and without them, and GradStats vs a naive loop.

    .venv/bin/python benchmarks/monitor_overhead.py               # ~70 s on 1 CPU thread; on a GPU when present
    .venv/bin/python benchmarks/monitor_overhead.py --rounds 10 --steps 20 --device cpu

Models: a tiny Llama, hidden 64, fp32, batch 8 x 64 tokens, in the two settings hf_stable serves:
* full fine-tune, 24 decoder layers: 219 trainable tensors (0.95 M values);
* LoRA (r 8 on all 7 projections), 16 decoder layers: 224 trainable tensors of 371.

1. Step time: the plain Trainer (default `max_grad_norm=1.0` clip) against the same run with every monitor of
   `build_monitors(MonitorsConfig())` on, `logging_steps=10`, in two ways:
   * `stock+mon`: the monitors as callbacks in the stock `Trainer` (a user's own script). Its clip reads every
     gradient once more after the monitors' pass.
   * `Stable+mon`: the same callbacks in `hf_stable.trainer.StableTrainer`, the recipe's Trainer, whose clip and
     logged `grad_norm` reuse the monitors' pass (one read of the gradients per step, as in the plain run).
   The CPU is shared with other jobs whose load swings step times by tens of percent within seconds, so the two
   arms are interleaved *per step*: within each run the monitors (and StableTrainer's shared clip) are on at even
   steps (which also carry every periodic check: logging-step max |g| and memory, update ratios every 20 steps)
   and off at odd steps (callbacks return at once, forward hooks paused, the stock clip runs line for line: a
   few microseconds of dispatch remain). A step's time is the interval between consecutive `on_step_end` (after
   a CUDA synchronize on a GPU), so data loading, the Trainer's logging and all our work are inside. Reported:
   the median over runs (fresh copies of the same weights) of (median monitored step / median plain step).
2. Gradient statistics of one backward (all of: per-group L2 norms, global norm, non-finite tensors per group,
   max |g| and where): the naive loop (per tensor `norm().item()`, `abs().max().item()`,
   `isfinite().all().item()`: 3 device->host reads per tensor) against `GradStats.compute(max_abs=True)` (one),
   interleaved, medians. On CPU an `.item()` is a plain memory read, so what remains is per-tensor op dispatch
   (~1 us per tensor and op even inside foreach calls), which bounds the CPU gap near 2.5x; on a GPU each naive
   `.item()` stalls the stream.

Last lines: `stock_trainer_overhead=<ratio>` and `monitor_overhead=<ratio> naive_vs_ours=<x>` (the recipe's
StableTrainer) — the worse (larger overhead, smaller speed-up) of the two settings. Goals: <= 1.02 and >= 10.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging as hf_logging

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.monitors import build_monitors
from hf_stable.config import MonitorsConfig
from hf_stable.core.grad_stats import GradStats
from hf_stable.core.step_tap import StepTap
from hf_stable.optim.roles import group_parameters
from hf_stable.trainer import StableTrainer

logging.getLogger("hf_stable").setLevel(logging.ERROR)
hf_logging.set_verbosity_error()
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


DEVICE = "cpu"  # set by --device


def _sync() -> None:
    """On a GPU, wait for queued kernels so a step's time is its own (the plain steps never sync by themselves)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class StepClock(TrainerCallback):
    def __init__(self):
        self.marks: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.marks.append(time.perf_counter())


class Alternate(StabilityCallback):
    """Switches every monitor on at even steps and off at odd ones (runs first among hf_stable callbacks); with a
    `ToggleTrainer`, also its shared-norm path (off: the stock Trainer's clip, line for line)."""

    def __init__(self, monitors):
        super().__init__()
        self.monitors = monitors
        self.flags: list[bool] = []
        self.trainer = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        on = (state.global_step + 1) % 2 == 0
        for cb in self.monitors:
            cb.enabled = on
        StepTap.shared(model)._paused = not on
        if self.trainer is not None:
            self.trainer.shared = on
        self.flags.append(on)


class ToggleTrainer(StableTrainer):
    """`StableTrainer` at monitored steps, the stock `Trainer._clip_grad_norm` / `_get_grad_norm` at plain ones."""

    shared = True

    def _reads_gradients(self, model) -> bool:
        return self.shared and super()._reads_gradients(model)


def build_model(layers: int, hidden: int, lora: bool):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    return model


def dataset(n: int, length: int):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (x := torch.randint(0, 512, (length,), generator=g)), "labels": x.clone()} for _ in range(n)]


def run_trainer(model, data, steps: int, out: str, stable: bool) -> tuple[list[float], list[float]]:
    """One run alternating monitored and plain steps; returns (plain step times, monitored step times).

    `stable`: monitored steps run `StableTrainer`'s shared-norm clip (the recipe's Trainer), plain steps the stock
    clip; otherwise the stock Trainer throughout, the monitors passed in as callbacks."""
    clock = StepClock()
    monitors = build_monitors(MonitorsConfig())
    switch = Alternate(monitors)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=8,
        max_steps=steps,
        logging_steps=10,
        report_to=[],
        use_cpu=DEVICE == "cpu",
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-4,
        dataloader_num_workers=0,
        seed=0,
    )
    cls = ToggleTrainer if stable else Trainer
    trainer = cls(model=model, args=args, train_dataset=data, callbacks=[switch, *monitors, clock])
    switch.trainer = trainer if stable else None
    trainer.remove_callback(PrinterCallback)  # no log lines inside the timing
    trainer.train()
    durations = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]  # step k+1's time, k >= 1
    plain, monitored = [], []
    for flag, d in list(zip(switch.flags[1:], durations, strict=False))[2:]:  # the first steps warm up
        (monitored if flag else plain).append(d)
    return plain, monitored


def step_overhead(base, data, rounds: int, steps: int, stable: bool) -> tuple[float, float, float, int]:
    ratios, plain_all, mon_all = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(rounds):
            plain, monitored = run_trainer(copy.deepcopy(base), data, steps, out, stable)
            ratios.append(statistics.median(monitored) / statistics.median(plain))
            plain_all += plain
            mon_all += monitored
    return statistics.median(ratios), statistics.median(plain_all), statistics.median(mon_all), len(plain_all)


def naive_stats(groups: dict) -> dict:
    out = {"norms": {}, "nonfinite": {}, "max": (-1.0, None)}
    total = 0.0
    for group, members in groups.items():
        sq, bad = 0.0, 0
        for name, p in members:
            n = p.grad.norm().item()
            sq += n * n
            m = p.grad.abs().max().item()
            if not torch.isfinite(p.grad).all().item():
                bad += 1
            elif m > out["max"][0]:
                out["max"] = (m, name)
        out["norms"][group], out["nonfinite"][group] = sq**0.5, bad
        total += sq
    out["global"] = total**0.5
    return out


def grad_stats_speed(model, repeats: int) -> tuple[float, float]:
    model.to(DEVICE)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    groups = {g: [(n, p) for n, p in members if p.grad is not None] for g, members in group_parameters(model).items()}
    stats = GradStats(model)
    reference, ours = naive_stats(groups), stats.compute(model, max_abs=True)
    assert abs(reference["global"] - ours.global_norm) <= 1e-4 * reference["global"], "GradStats disagrees"
    assert reference["max"][1] == ours.max_abs_param, "GradStats places max |g| elsewhere"
    naive_t, ours_t = [], []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        naive_stats(groups)
        t1 = time.perf_counter()
        stats.compute(model, max_abs=True)  # step=None: no cache, a full computation every time
        t2 = time.perf_counter()
        naive_t.append(t1 - t0)
        ours_t.append(t2 - t1)
    return statistics.median(naive_t), statistics.median(ours_t)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="Trainer runs per setting")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per Trainer run (half monitored)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=60, help="interleaved repeats of the grad-stats timing")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least disturbed by load)")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda when available (where each naive .item() stalls the stream), else cpu",
    )
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    data = dataset(8 * args.steps, 64)
    rows = []
    for label, layers, lora in (("full fine-tune, 24 layers", 24, False), ("LoRA r8, 16 layers", 16, True)):
        base = build_model(layers, args.hidden, lora)
        n_train = sum(1 for p in base.parameters() if p.requires_grad)
        n_all = sum(1 for _ in base.parameters())
        stock = step_overhead(base, data, args.rounds, args.steps, stable=False)
        stable = step_overhead(base, data, args.rounds, args.steps, stable=True)
        naive, ours = grad_stats_speed(copy.deepcopy(base), args.repeats)
        rows.append((f"{label} ({n_train}/{n_all} tensors)", stock, stable, naive, ours, n_train))

    print(
        f"{'setting':<40}{'plain ms':>9}{'stock+mon':>10}{'ratio':>7}{'Stable+mon':>11}{'ratio':>7}"
        f"{'naive ms':>9}{'ours ms':>8}{'speed-up':>9}{'transfers':>11}"
    )
    for label, stock, stable, naive, ours, n_train in rows:
        plain = statistics.median([stock[1], stable[1]])
        print(
            f"{label:<40}{plain * 1e3:>9.2f}{stock[2] * 1e3:>10.2f}{stock[0]:>7.3f}{stable[2] * 1e3:>11.2f}"
            f"{stable[0]:>7.3f}{naive * 1e3:>9.3f}{ours * 1e3:>8.3f}{naive / ours:>9.1f}{f'{3 * n_train}/1':>11}"
        )
    print(
        "ratio: median over runs of (median monitored step / median plain step), steps alternating within a run; "
        "plain = the stock Trainer with its default max_grad_norm=1.0 clip. stock+mon: the monitors as callbacks "
        "in the stock Trainer (its clip reads the gradients again); Stable+mon: the same callbacks in "
        "StableTrainer (the recipe's Trainer: its clip and grad_norm reuse the monitors' pass). speed-up: naive "
        "per-tensor .item() loop / GradStats.compute(max_abs=True), same statistics; transfers: device->host "
        "reads per step, naive / ours"
    )
    print(
        f"wall time {time.perf_counter() - t_start:.0f} s; device {DEVICE}; "
        f"torch CPU threads {torch.get_num_threads()}"
    )
    worst_speedup = min(r[3] / r[4] for r in rows)
    print(f"stock_trainer_overhead={max(r[1][0] for r in rows):.3f}")
    print(f"monitor_overhead={max(r[2][0] for r in rows):.3f} naive_vs_ours={worst_speedup:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
