"""Where a training step's time goes: the bare `StableTrainer` against the recipe's default callbacks, part by part.

    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py [--rounds 5] [--breakdown-rounds 2] [--steps 60]
        [--clock thread|wall] [--arms bare,default,trainer_adamw] [--adamw-impl auto]
        [--set SECTION.FIELD=VALUE ...]

An arm may carry its own config fields after `@`: `--arms bare,default,default@attention.monitor_interval=0` trains
the default layer with and without the sampled attention probe beside the bare step, in the same interleaved rounds
(several fields: `default@a.b=1@c.d=2`); the fields read when the trainer is built (callbacks, attention, guards, the
optimizer) take effect, the data is the run's. With more arms than `bare` and `default`, a last table gives every arm's
paired per-round difference and ratio against the first arm named.

Builds the recipe's pieces in-process as `scripts/finetune.py` does (the embedded default: its base, data, LoRA r 16
on the 7 projections, the optimizer factory's groups, `StableTrainer` with the chunked loss) and trains `--steps`
steps per arm:

* `bare`: `StableTrainer` with only the preemption / checkpoint-marker / printer callbacks (its own shared-norm
  clip at the Trainer's default `max_grad_norm=1.0`).
* `default`: `build_callbacks(cfg, args, records)`: every default monitor and guard, the attention-logit monitor,
  the spike forensics' screening, with `guard_training_overrides` (hf_stable clips).
* `trainer_adamw`: `bare` with the Trainer's own optimizer (`adamw_torch_fused`, 2 groups: what TRL's SFTTrainer
  builds) instead of the factory's (LLRD x LoRA+ groups): the optimizer column against TRL's.

Two kinds of rounds, the order of the arms rotated each round:

* `--rounds` plain, interleaved rounds give the ratio: every arm is built in the one process and trained in its own
  thread, one running at a time, the baton handed on at each step, so the arms' steps alternate one by one and a
  machine whose speed drifts (a shared host: up to 15 % over minutes) slows them alike. Only what every arm has is
  timed: forward (`compute_loss`, the chunked loss and every forward hook in it), backward (`accelerator.backward`),
  grad norm (`_clip_grad_norm` / `_get_grad_norm`), optimizer (the torch optimizer's `step`), callbacks (the
  handler's `call_event`, all callbacks together) and other (the rest: data, zero_grad, the LR schedule, the
  Trainer's logging). A step runs from taking the baton to handing it on.
* `--breakdown-rounds` instrumented rounds, one arm at a time, give the per-callback table: every hook that is not
  TrainerCallback's no-op is timed by class. Timing a hook costs ~1-2 us a call, ~0.05-0.1 ms a step with the
  default layer's ~45 hooked calls, which is why the ratio does not come from these.

Regions nest (a callback called inside another region counts for itself only). Clock: `thread` (default) is this
thread's CPU time (`time.thread_time`); `wall` for an idle machine (a GPU: the step marks synchronize). Steps 1-2 of
each run and the last are left out; a part's value is its mean over the remaining steps, the tables show medians over
rounds, and `default - bare` the median of the paired per-round differences. On a 2-core machine pin the run to one
core (`taskset -c 1`); the interleaved per-round ratio scatters by ~±1 % (each round builds fresh models, whose
memory layout moves a step by about that much), so take 6 or more rounds.

Last line: `layer_ms=<median paired difference default - bare over grad norm + optimizer + callbacks, interleaved>
layer_ratio=<median paired ratio> layer_ratio_min=<> layer_ratio_max=<> optimizer_ms=<factory, bare arm, instrumented>
trainer_optimizer_ms=<trainer_adamw, instrumented> clock=<clock>`. `layer_ms` is the layer's own time; the forward
hooks it adds (the loss tap, the sampled attention probe, the forensics' per-row statistics) are in the forward column.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from step_timing import WARMUP, Baton, Profile, instrument, interleave, make_clock_callback, step_clock, step_sync

PARTS = ("forward", "backward", "grad norm", "optimizer", "callbacks", "other")
ARMS = ("bare", "default", "trainer_adamw")


def prepare(steps: int, out: str, adamw_impl: str, overrides: list[str] = ()):
    from hf_stable.config import load_config
    from hf_stable.data import build_data
    from hf_stable.modeling import load_tokenizer, resolve_base

    argv = ["--training.max_steps", str(steps), "--training.output_dir", out, "--evaluation.before", "false"]
    argv += ["--optim.adamw_impl", adamw_impl]
    argv += as_argv(overrides)
    cfg = load_config(argv=argv)
    base = resolve_base(cfg.model)
    tokenizer = load_tokenizer(cfg.model, base)
    data = build_data(cfg.data, tokenizer, seed=cfg.training.get("seed", 42), batch_size=16)
    return cfg, base, tokenizer, data, argv


def as_argv(items) -> list[str]:
    """`section.field=value` items as the recipe's `--section.field value` arguments."""
    return [arg for item in items for arg in (f"--{item.partition('=')[0]}", item.partition("=")[2])]


def split_arm(spec: str) -> tuple[str, list[str]]:
    """(`bare` / `default` / `trainer_adamw`, the arm's own `section.field=value` items) of an arm spec."""
    kind, *fields = spec.split("@")
    return kind, fields


def arm_config(spec: str, prepared):
    """The run's config with the arm's own fields (`split_arm`) set, loaded and checked as the recipe's."""
    from hf_stable.config import load_config

    cfg, argv = prepared[0], prepared[4]
    _, fields = split_arm(spec)
    return load_config(argv=[*argv, *as_argv(fields)]) if fields else cfg


def build_arm(arm: str, prepared, clock: str, breakdown: bool = True, marks=None):
    """(trainer, profile) of one arm; `marks`: the step-marks callback (default: the breakdown's)."""
    from transformers import set_seed

    from hf_stable.callbacks import build_callbacks
    from hf_stable.callbacks.builder import runtime_callbacks
    from hf_stable.callbacks.compact_printer import CompactPrinter
    from hf_stable.callbacks.guards import guard_training_overrides
    from hf_stable.config import training_arguments
    from hf_stable.modeling import apply_lora, load_model
    from hf_stable.optim import build_optimizer, trainer_optimizer_arguments
    from hf_stable.trainer import StableTrainer

    _, base, tokenizer, data, _ = prepared
    cfg = arm_config(arm, prepared)
    arm, fields = split_arm(arm)
    out_dir = "_".join([arm, *(f.replace("/", "_") for f in fields)])
    forced = {"remove_unused_columns": False, "output_dir": os.path.join(cfg.training["output_dir"], out_dir)}
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
    profile = Profile(step_clock(clock))
    if marks is None:
        marks = make_clock_callback(profile, step_sync(clock, args))
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
    if breakdown:
        instrument(trainer, profile, skip=marks)
    return trainer, profile


def run_arm(arm: str, prepared, clock: str, breakdown: bool = True) -> dict[str, float]:
    trainer, profile = build_arm(arm, prepared, clock, breakdown)
    trainer.train()
    return profile.summary()


def run_interleaved(arms: list[str], prepared, clock: str) -> dict[str, dict[str, float]]:
    """Per arm, the mean ms of a step and of its parts, the arms trained in one process with their steps alternating
    one by one (each in its own thread, one running at a time); steps 1-2 and the last are left out, as in
    `Profile.summary`."""
    from transformers import TrainerCallback

    baton = Baton(len(arms))
    steps: dict[str, list[float]] = {arm: [] for arm in arms}
    built = [build_arm(arm, prepared, clock, breakdown=False, marks=TrainerCallback()) for arm in arms]
    for i, (arm, (trainer, profile)) in enumerate(zip(arms, built, strict=True)):
        interleave(trainer, baton, i, profile, steps[arm], step_sync(clock))
    errors = []

    def train(trainer):
        try:
            trainer.train()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=train, args=(t,)) for t, _ in built]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out = {}
    for arm, (_, profile) in zip(arms, built, strict=True):
        rows = []
        for k in range(WARMUP, len(steps[arm]) - 1):
            row = {name: 1e3 * v for name, v in profile.steps[k].items()}
            row["total"] = 1e3 * steps[arm][k]
            row["callbacks"] = row.pop("cb:all", 0.0)
            row["other"] = row["total"] - sum(v for n, v in row.items() if n not in ("total", "other"))
            rows.append(row)
        out[arm] = {n: statistics.fmean(r.get(n, 0.0) for r in rows) for n in {n for r in rows for n in r}}
    return out


def table(results: dict[str, list[dict]], rounds: int) -> str:
    def med(arm, key):
        return statistics.median(r.get(key, 0.0) for r in results[arm])

    arms = [a for a in results if results.get(a)]
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


def paired_medians(rows: list[dict], reference: list[dict]) -> list[float]:
    """Per part (and the total), the median over rounds of `rows` minus `reference` (paired round by round)."""
    pairs = list(zip(rows, reference, strict=True))
    return [statistics.median(x.get(p, 0.0) - y.get(p, 0.0) for x, y in pairs) for p in (*PARTS, "total")]


def paired_ratios(rows: list[dict], reference: list[dict]) -> list[float]:
    """Each round's total of `rows` over the same round's total of `reference`."""
    return [x["total"] / y["total"] for x, y in zip(rows, reference, strict=True)]


def against_first(arms: list[str], plain: dict[str, list[dict]]) -> str:
    """Every other arm's paired per-round difference (ms, median over rounds) per part and ratio against the first
    arm named, from the interleaved rounds."""
    first = arms[0]
    lines = [
        f"\npaired per-round differences against `{first}` (ms per step, medians over {len(plain[first])} rounds)\n",
        "| arm | " + " | ".join(PARTS) + " | total | ratio | per-round ratios |",
        "|---" * (len(PARTS) + 4) + "|",
    ]
    for arm in arms[1:]:
        ratios = paired_ratios(plain[arm], plain[first])
        diffs = [f"{d:+.3f}" for d in paired_medians(plain[arm], plain[first])]
        lines.append(
            f"| {arm} | "
            + " | ".join(diffs)
            + f" | {statistics.median(ratios):.3f} | "
            + " ".join(f"{r:.3f}" for r in ratios)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--breakdown-rounds",
        type=int,
        default=2,
        help="rounds with every hook timed (the per-part table); the paired ratio comes from the --rounds plain runs",
    )
    p.add_argument("--clock", choices=("thread", "wall"), default="thread")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--adamw-impl", default="auto", choices=("auto", "fused", "foreach", "for_loop"))
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="a config field for every arm, e.g. --set attention.monitor_interval=0 (repeatable)",
    )
    a = p.parse_args(argv)
    arms = a.arms.split(",")
    if unknown := {split_arm(arm)[0] for arm in arms} - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)} (each optionally @SECTION.FIELD=VALUE)")
    if len(set(arms)) != len(arms):
        p.error(f"--arms names an arm twice: {a.arms}")
    results: dict[str, list[dict]] = {arm: [] for arm in arms}  # the instrumented runs: the per-part table
    plain: dict[str, list[dict]] = {arm: [] for arm in arms}  # the plain runs' common parts: the paired ratio
    with tempfile.TemporaryDirectory() as out:
        prepared = prepare(a.steps, out, a.adamw_impl, a.set)
        for r in range(a.rounds):  # plain rounds: the arms' steps interleaved, only the common parts timed
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            parts = run_interleaved(order, prepared, a.clock)
            for arm in order:
                plain[arm].append(parts[arm])
                print(
                    f"round={r} plain arm={arm} "
                    + " ".join(f"{p}={parts[arm].get(p, 0.0):.2f}" for p in (*PARTS, "total")),
                    flush=True,
                )
        for r in range(a.breakdown_rounds):  # instrumented rounds, one arm at a time: the per-part table
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                res = run_arm(arm, prepared, a.clock)
                results[arm].append(res)
                print(f"round={r} breakdown arm={arm} total_ms={res['total']:.2f}", flush=True)
    print(
        f"\nclock={a.clock} ms per step, steps {WARMUP + 1}..{a.steps - 1}, median over {a.breakdown_rounds} "
        "instrumented rounds\n"
    )
    if a.breakdown_rounds:
        print(table(results, a.breakdown_rounds))
    ratios = paired_ratios(plain["default"], plain["bare"]) if {"bare", "default"} <= set(arms) else []
    nan = float("nan")
    if plain.get("bare") and plain.get("default"):
        print(
            f"\ninterleaved plain runs, ms per step, median over {a.rounds} rounds (default - bare: median of the"
            " paired per-round differences)\n"
        )
        print("| arm | " + " | ".join(PARTS) + " | total |\n" + "|---" * (len(PARTS) + 2) + "|")
        for arm in ("bare", "default"):
            print(
                f"| {arm} | "
                + " | ".join(f"{statistics.median(r.get(p, 0.0) for r in plain[arm]):.2f}" for p in (*PARTS, "total"))
                + " |"
            )
        print(
            "| default - bare | "
            + " | ".join(f"{d:+.3f}" for d in paired_medians(plain["default"], plain["bare"]))
            + " |"
        )
    if ratios:
        print("\npaired per-round ratio default/bare: " + " ".join(f"{x:.3f}" for x in ratios))
    if a.rounds and not set(arms) <= {"bare", "default"}:
        print(against_first(arms, plain))
    opt = statistics.median(r["optimizer"] for r in results["bare"]) if results.get("bare") else nan
    trainer_opt = (
        statistics.median(r["optimizer"] for r in results["trainer_adamw"]) if results.get("trainer_adamw") else nan
    )
    own = ("grad norm", "optimizer", "callbacks")  # the parts the layer adds to directly (forward hooks aside)
    pairs = zip(plain.get("default", []), plain.get("bare", []), strict=False)  # interleaved: the steadier pairs
    layer_ms = [sum(d.get(p, 0.0) - b.get(p, 0.0) for p in own) for d, b in pairs]
    print(
        f"layer_ms={statistics.median(layer_ms) if layer_ms else nan:.3f} "
        f"layer_ratio={statistics.median(ratios) if ratios else nan:.3f} layer_ratio_min={min(ratios, default=nan):.3f} "
        f"layer_ratio_max={max(ratios, default=nan):.3f} optimizer_ms={opt:.3f} trainer_optimizer_ms={trainer_opt:.3f} "
        f"clock={a.clock}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
