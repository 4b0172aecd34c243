"""Where a training step's time goes: the bare `StableTrainer` against the recipe's default callbacks, part by part.

    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py [--rounds 5] [--steps 60] [--clock thread|wall]
                                                         [--arms bare,default,trainer_adamw] [--adamw-impl auto]

Builds the recipe's pieces in-process as `scripts/finetune.py` does (the embedded default: its base, data, LoRA r 16
on the 7 projections, the optimizer factory's groups, `StableTrainer` with the chunked loss) and trains `--steps`
steps per arm, the arms alternating inside the one process (`--rounds` rounds, the order rotated each round):

* `bare`: `StableTrainer` with only the preemption / checkpoint-marker / printer callbacks (its own shared-norm
  clip at the Trainer's default `max_grad_norm=1.0`).
* `default`: `build_callbacks(cfg, args, records)`: every default monitor and guard, the attention-logit monitor,
  the spike forensics' screening, with `guard_training_overrides` (hf_stable clips).
* `trainer_adamw`: `bare` with the Trainer's own optimizer (`adamw_torch_fused`, 2 groups: what TRL's SFTTrainer
  builds) instead of the factory's (LLRD x LoRA+ groups): the optimizer column against TRL's.

Each step (from one `on_step_begin` to the next) is split into forward (`compute_loss`, the chunked loss and every
forward hook in it), backward (`accelerator.backward`), grad norm (`_clip_grad_norm` / `_get_grad_norm`), optimizer
(the torch optimizer's `step`), each callback by class (all its hooks that step) and other (the rest: data, zero_grad,
the LR schedule, the Trainer's logging). Regions nest (a callback called inside another region counts for itself
only). Clock: `thread` (default) is this thread's CPU time (`time.thread_time`); with `OMP_NUM_THREADS=1` every op runs
on it, so the numbers hold on a machine other jobs share; `wall` for an idle machine (a GPU: the step marks
synchronize). Steps 1-2 of each run are warm-up and left out; a part's value is its mean over the remaining steps,
the table shows the median over rounds; the paired ratio is `default / bare` total of the same round.

On a 2-core machine, pin the run to one core (`taskset -c 1`) and take `--rounds 10`: the paired per-round ratio
scatters by ~2 % between rounds there (a median of 5 moved by ~1 % between runs), the part totals less.

Last line: `layer_ms=<median of default - bare over grad norm + optimizer + callbacks> layer_ratio=<median>
layer_ratio_min=<> layer_ratio_max=<> optimizer_ms=<factory, bare arm> trainer_optimizer_ms=<trainer_adamw>
clock=<clock>`. `layer_ms` is the layer's own time, steadier than the total ratio on a shared machine (forward and
backward scatter by ~1 ms between runs there); the forward hooks it adds (the loss tap, sampled attention probe, the
forensics' per-row statistics) are in the forward column only.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WARMUP = 2
PARTS = ("forward", "backward", "grad norm", "optimizer", "callbacks", "other")
ARMS = ("bare", "default", "trainer_adamw")


class Profile:
    """Exclusive time per named region, per training step (regions nest: a parent's time excludes its children)."""

    def __init__(self, clock):
        self.now = clock
        self.stack: list[list] = []
        self.steps: list[dict[str, float]] = []
        self.marks: list[float] = []

    def mark_step(self) -> None:
        self.marks.append(self.now())
        self.steps.append({})

    def push(self, name: str) -> None:
        self.stack.append([name, self.now(), 0.0])

    def pop(self) -> None:
        name, start, child = self.stack.pop()
        elapsed = self.now() - start
        if self.stack:
            self.stack[-1][2] += elapsed
        if self.steps:
            self.steps[-1][name] = self.steps[-1].get(name, 0.0) + elapsed - child

    def wrap(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.push(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.pop()

        return timed

    def summary(self) -> dict[str, float]:
        """Mean ms per timed step: each region, `callbacks` (their sum), `other` and `total`."""
        rows = []
        for k in range(WARMUP, len(self.marks) - 1):
            row = {name: 1e3 * s for name, s in self.steps[k].items()}
            row["total"] = 1e3 * (self.marks[k + 1] - self.marks[k])
            row["callbacks"] = sum(v for n, v in row.items() if n.startswith("cb:"))
            row["other"] = row["total"] - sum(v for n, v in row.items() if n not in ("total", "callbacks", "other"))
            rows.append(row)
        names = {n for row in rows for n in row}
        return {n: statistics.fmean(row.get(n, 0.0) for row in rows) for n in names}


def instrument(trainer, profile: Profile, skip) -> None:
    """Time the trainer's parts and every callback hook that is not TrainerCallback's no-op."""
    from transformers import TrainerCallback

    trainer.compute_loss = profile.wrap(trainer.compute_loss, "forward")
    trainer.accelerator.backward = profile.wrap(trainer.accelerator.backward, "backward")
    trainer._clip_grad_norm = profile.wrap(trainer._clip_grad_norm, "grad norm")
    trainer._get_grad_norm = profile.wrap(trainer._get_grad_norm, "grad norm")
    hooks = [n for n in vars(TrainerCallback) if n.startswith("on_")]
    for cb in trainer.callback_handler.callbacks:
        if cb is skip:
            continue
        for hook in hooks:
            if getattr(type(cb), hook, None) is not getattr(TrainerCallback, hook):
                setattr(cb, hook, profile.wrap(getattr(cb, hook), f"cb:{type(cb).__name__}"))


def make_clock_callback(profile: Profile, sync):
    from transformers import TrainerCallback

    class StepMarks(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> the torch optimizer
            self.handles = [
                inner.register_step_pre_hook(lambda *a: profile.push("optimizer")),
                inner.register_step_post_hook(lambda *a: profile.pop()),
            ]

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            profile.mark_step()

        def on_train_end(self, args, state, control, **kwargs):
            sync()
            profile.mark_step()
            for h in self.handles:
                h.remove()

    return StepMarks()


def prepare(steps: int, out: str, adamw_impl: str):
    from hf_stable.config import load_config
    from hf_stable.data import build_data
    from hf_stable.modeling import load_tokenizer, resolve_base

    argv = ["--training.max_steps", str(steps), "--training.output_dir", out, "--evaluation.before", "false"]
    argv += ["--optim.adamw_impl", adamw_impl]
    cfg = load_config(argv=argv)
    base = resolve_base(cfg.model)
    tokenizer = load_tokenizer(cfg.model, base)
    data = build_data(cfg.data, tokenizer, seed=cfg.training.get("seed", 42), batch_size=16)
    return cfg, base, tokenizer, data


def run_arm(arm: str, prepared, clock: str) -> dict[str, float]:
    import torch
    from transformers import set_seed

    from hf_stable.callbacks import build_callbacks
    from hf_stable.callbacks.builder import runtime_callbacks
    from hf_stable.callbacks.compact_printer import CompactPrinter
    from hf_stable.callbacks.guards import guard_training_overrides
    from hf_stable.config import training_arguments
    from hf_stable.modeling import apply_lora, load_model
    from hf_stable.optim import build_optimizer, trainer_optimizer_arguments
    from hf_stable.trainer import StableTrainer

    cfg, base, tokenizer, data = prepared
    forced = {"remove_unused_columns": False}
    if arm == "default":
        forced.update(guard_training_overrides(cfg.stability.guards, cfg.training, warn=False))
    args = training_arguments(cfg, **forced)
    set_seed(args.seed)
    model = apply_lora(load_model(cfg, base), cfg.lora, args.gradient_checkpointing)
    set_seed(args.seed)
    if arm == "default":
        callbacks = build_callbacks(cfg, args, records=data.records)
    else:
        callbacks = [*runtime_callbacks(cfg.runtime), CompactPrinter()]
    if arm == "trainer_adamw":
        optimizer_kwargs = {}
    else:
        optimizer_kwargs = trainer_optimizer_arguments(build_optimizer(model, cfg.optim, args), cfg.optim, args)
    cuda = torch.cuda.is_available() and not args.use_cpu
    profile = Profile(time.thread_time if clock == "thread" else time.perf_counter)
    marks = make_clock_callback(profile, torch.cuda.synchronize if cuda and clock == "wall" else lambda: None)
    trainer = StableTrainer(
        model=model,
        args=args,
        train_dataset=data.train_dataset,
        data_collator=data.collator,
        processing_class=tokenizer,
        callbacks=[marks, *callbacks],
        training_loss=cfg.training_loss,
        **optimizer_kwargs,
    )
    instrument(trainer, profile, skip=marks)
    trainer.train()
    return profile.summary()


def table(results: dict[str, list[dict]], rounds: int) -> str:
    def med(arm, key):
        return statistics.median(r.get(key, 0.0) for r in results[arm])

    arms = [a for a in ARMS if results.get(a)]
    lines = ["| arm | " + " | ".join(PARTS) + " | total |", "|---" * (len(PARTS) + 2) + "|"]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(f"{med(arm, p):.2f}" for p in (*PARTS, "total")) + " |")
    names = sorted(
        {n for a in arms for r in results[a] for n in r if n.startswith("cb:")},
        key=lambda n: -max(med(a, n) for a in arms),
    )
    lines += ["", "| callback | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    lines += [f"| {n[3:]} | " + " | ".join(f"{med(a, n):.3f}" for a in arms) + " |" for n in names]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--clock", choices=("thread", "wall"), default="thread")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--adamw-impl", default="auto", choices=("auto", "fused", "foreach", "for_loop"))
    a = p.parse_args(argv)
    arms = a.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    ratios = []
    with tempfile.TemporaryDirectory() as out:
        prepared = prepare(a.steps, out, a.adamw_impl)
        for r in range(a.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                res = run_arm(arm, prepared, a.clock)
                results[arm].append(res)
                print(
                    f"round={r} arm={arm} total_ms={res['total']:.2f} callbacks_ms={res['callbacks']:.2f}", flush=True
                )
            if "bare" in results and "default" in results:
                ratios.append(results["default"][-1]["total"] / results["bare"][-1]["total"])
    print(f"\nclock={a.clock} ms per step, steps {WARMUP + 1}..{a.steps - 1}, median over {a.rounds} rounds\n")
    print(table(results, a.rounds))
    nan = float("nan")
    if ratios:
        print("\npaired per-round ratio default/bare: " + " ".join(f"{x:.3f}" for x in ratios))
    opt = statistics.median(r["optimizer"] for r in results["bare"]) if results.get("bare") else nan
    trainer_opt = (
        statistics.median(r["optimizer"] for r in results["trainer_adamw"]) if results.get("trainer_adamw") else nan
    )
    own = ("grad norm", "optimizer", "callbacks")  # the parts the layer adds to directly (forward hooks aside)
    pairs = zip(results.get("default", []), results.get("bare", []), strict=False)
    layer_ms = [sum(d.get(p, 0.0) - b.get(p, 0.0) for p in own) for d, b in pairs]
    print(
        f"layer_ms={statistics.median(layer_ms) if layer_ms else nan:.3f} "
        f"layer_ratio={statistics.median(ratios) if ratios else nan:.3f} layer_ratio_min={min(ratios, default=nan):.3f} "
        f"layer_ratio_max={max(ratios, default=nan):.3f} optimizer_ms={opt:.3f} trainer_optimizer_ms={trainer_opt:.3f} "
        f"clock={a.clock}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
