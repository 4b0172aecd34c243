"""Cost of the stability monitors: Trainer step time with and without them, and GradStats vs a naive loop.

    .venv/bin/python benchmarks/monitor_overhead.py               # CPU, ~1-1.5 min
    .venv/bin/python benchmarks/monitor_overhead.py --rounds 10 --steps 20

Models: a tiny Llama, hidden 64, fp32, batch 8 x 64 tokens, in the two settings hf_stable serves:
* full fine-tune, 24 decoder layers: 219 trainable tensors (0.95 M values);
* LoRA (r 8 on all 7 projections), 16 decoder layers: 224 trainable tensors of 371.

1. Step time: the plain Trainer (default `max_grad_norm=1.0` clip) against the same Trainer with every monitor
   of `build_monitors(MonitorsConfig())` on, `logging_steps=10`. The CPU is shared with other jobs whose load
   swings step times by tens of percent within seconds, so the two are interleaved *per step*: within each run
   the monitors are on at even steps (which also carry every periodic check: logging-step max |g| and memory,
   update ratios every 20 steps) and off at odd steps (callbacks return at once, forward hooks paused: a few
   microseconds of dispatch remain). A step's time is the interval between consecutive `on_step_end`, so data
   loading, the Trainer's logging and all our work are inside. Reported: the median over runs (fresh copies
   of the same weights) of (median monitored step / median plain step).
2. Gradient statistics of one backward (all of: per-group L2 norms, global norm, non-finite tensors per group,
   max |g| and where): the naive loop (per tensor `norm().item()`, `abs().max().item()`,
   `isfinite().all().item()`) against `GradStats.compute(max_abs=True)`, interleaved, medians. On CPU an
   `.item()` costs no device sync, so this understates the gap on a GPU, where each one stalls the stream.

Last line: `monitor_overhead=<ratio> naive_vs_ours=<x>` — the worse (larger overhead, smaller speed-up) of the
two settings. Goals: <= 1.02 and >= 10.
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

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_stable.callbacks.base import StabilityCallback  # noqa: E402
from hf_stable.callbacks.grad_stats import GradStats  # noqa: E402
from hf_stable.callbacks.monitors import build_monitors  # noqa: E402
from hf_stable.callbacks.step_tap import StepTap  # noqa: E402
from hf_stable.config import MonitorsConfig  # noqa: E402
from hf_stable.optim.roles import group_parameters  # noqa: E402

logging.getLogger("hf_stable").setLevel(logging.ERROR)
hf_logging.set_verbosity_error()
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class StepClock(TrainerCallback):
    def __init__(self):
        self.marks: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())


class Alternate(StabilityCallback):
    """Switches every monitor on at even steps and off at odd ones (runs first among hf_stable callbacks)."""

    def __init__(self, monitors):
        super().__init__()
        self.monitors = monitors
        self.flags: list[bool] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        on = (state.global_step + 1) % 2 == 0
        for cb in self.monitors:
            cb.enabled = on
        StepTap.shared(model)._paused = not on
        self.flags.append(on)


def build_model(layers: int, hidden: int, lora: bool):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    return model


def dataset(n: int, length: int):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (x := torch.randint(0, 512, (length,), generator=g)), "labels": x.clone()} for _ in range(n)]


def run_trainer(model, data, steps: int, out: str) -> tuple[list[float], list[float]]:
    """One run alternating monitored and plain steps; returns (plain step times, monitored step times)."""
    clock = StepClock()
    monitors = build_monitors(MonitorsConfig())
    switch = Alternate(monitors)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=steps, logging_steps=10,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                             dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[switch, *monitors, clock])
    trainer.remove_callback(PrinterCallback)  # no log lines inside the timing
    trainer.train()
    durations = [b - a for a, b in zip(clock.marks, clock.marks[1:])]  # step k+1's time, k >= 1
    plain, monitored = [], []
    for flag, d in list(zip(switch.flags[1:], durations))[2:]:  # the first steps warm up
        (monitored if flag else plain).append(d)
    return plain, monitored


def step_overhead(base, data, rounds: int, steps: int) -> tuple[float, float, float, int]:
    ratios, plain_all, mon_all = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(rounds):
            plain, monitored = run_trainer(copy.deepcopy(base), data, steps, out)
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
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    groups = {g: [(n, p) for n, p in members if p.grad is not None] for g, members in group_parameters(model).items()}
    stats = GradStats(model)
    reference, ours = naive_stats(groups), stats.compute(model, max_abs=True)
    assert abs(reference["global"] - ours.global_norm) <= 1e-4 * reference["global"], "GradStats disagrees"
    assert reference["max"][1] == ours.max_abs_param, "GradStats places max |g| elsewhere"
    naive_t, ours_t = [], []
    for _ in range(repeats):
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    data = dataset(8 * args.steps, 64)
    rows = []
    for label, layers, lora in (("full fine-tune, 24 layers", 24, False), ("LoRA r8, 16 layers", 16, True)):
        base = build_model(layers, args.hidden, lora)
        n_train = sum(1 for p in base.parameters() if p.requires_grad)
        n_all = sum(1 for _ in base.parameters())
        ratio, plain, mon, n = step_overhead(base, data, args.rounds, args.steps)
        naive, ours = grad_stats_speed(copy.deepcopy(base), args.repeats)
        rows.append((f"{label} ({n_train}/{n_all} tensors)", plain, mon, ratio, n, naive, ours))

    print(f"{'setting':<40}{'plain ms':>10}{'+monitors':>11}{'overhead':>10}{'pairs':>7}"
          f"{'naive ms':>10}{'ours ms':>9}{'speed-up':>10}")
    for label, plain, mon, ratio, n, naive, ours in rows:
        print(f"{label:<40}{plain * 1e3:>10.2f}{mon * 1e3:>11.2f}{ratio:>10.3f}{n:>7}"
              f"{naive * 1e3:>10.3f}{ours * 1e3:>9.3f}{naive / ours:>10.1f}")
    print("overhead: median over runs of (median monitored step / median plain step), steps alternating within a "
          "run; both with the default max_grad_norm=1.0 clip. speed-up: naive per-tensor .item() loop / "
          "GradStats.compute(max_abs=True), same statistics")
    print(f"wall time {time.perf_counter() - t_start:.0f} s; torch CPU threads {torch.get_num_threads()}")
    worst_overhead = max(r[3] for r in rows)
    worst_speedup = min(r[5] / r[6] for r in rows)
    print(f"monitor_overhead={worst_overhead:.3f} naive_vs_ours={worst_speedup:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
