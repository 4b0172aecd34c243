"""The default recipe eager vs ``training.torch_compile: true``: steps/s after warm-up and the compilations it took.

    OMP_NUM_THREADS=1 python benchmarks/compile.py [--steps 125] [--warmup 10] [--rounds 1] [--override KEY VALUE ...]

Builds the recipe's pieces in-process as `scripts/finetune.py` does (the embedded base, its data, LoRA, the optimizer
groups, every callback, `StableTrainer` with the chunked loss) and trains `--steps` steps (default 125: one epoch of
the embedded default, 2000 records at batch 16) once per arm, the arms alternating (eager, compiled, eager, compiled
... for `--rounds`). A compiled arm starts from a reset dynamo cache, so its counts are its own. Steps/s is taken
over the steps after `--warmup` (the first compiled steps hold the compilations). `--override` passes dotted recipe
keys (e.g. ``--override data.shape_buckets 0`` for the unbucketed baseline).

Each arm prints one line; the last line is machine-readable:
    compiled_vs_eager=<steps/s ratio> graphs=<n> recompiles=<n> most_of_one=<n> graph_breaks=<n> buckets=<n>

``graphs`` counts the FX graphs compiled (the compilations that cost time); ``recompiles`` the functions dynamo
converted again after a guard failed; ``most_of_one`` the most conversions of one function (dynamo gives up on a
function at 8 and runs it eagerly).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def run_arm(compiled: bool, steps: int, warmup: int, overrides: list[str], out: str) -> dict:
    from transformers import TrainerCallback, set_seed

    from hf_stable.callbacks import build_callbacks
    from hf_stable.callbacks.guards import guard_training_overrides
    from hf_stable.compat import dynamo_compile_counts, reset_dynamo
    from hf_stable.config import load_config, training_arguments
    from hf_stable.data import build_data
    from hf_stable.data.collators import shape_bucket_count
    from hf_stable.modeling import apply_lora, load_model, load_tokenizer, resolve_base
    from hf_stable.optim import build_optimizer, trainer_optimizer_arguments
    from hf_stable.trainer import StableTrainer

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

    argv = [
        *overrides,
        "--training.torch_compile",
        str(compiled).lower(),
        "--training.max_steps",
        str(steps),
        "--training.output_dir",
        out,
        "--training.logging_steps",
        str(max(steps, 1)),
        "--evaluation.before",
        "false",
    ]
    cfg = load_config(argv=argv)
    resolve_base(cfg.model)
    args = training_arguments(
        cfg, remove_unused_columns=False, **guard_training_overrides(cfg.stability.guards, cfg.training)
    )
    base = resolve_base(cfg.model)
    tokenizer = load_tokenizer(cfg.model, base)
    model = load_model(cfg, base)
    data = build_data(
        cfg.data,
        tokenizer,
        seed=args.seed,
        batch_size=args.per_device_train_batch_size,
        torch_compile=args.torch_compile,
    )
    set_seed(args.seed)
    model = apply_lora(model, cfg.lora, args.gradient_checkpointing)
    optimizer = build_optimizer(model, cfg.optim, args)
    clock = StepClock()
    trainer = StableTrainer(
        model=model,
        args=args,
        train_dataset=data.train_dataset,
        data_collator=data.collator,
        processing_class=tokenizer,
        callbacks=[*build_callbacks(cfg, args, records=data.records), clock],
        training_loss=cfg.training_loss,
        **trainer_optimizer_arguments(optimizer, cfg.optim, args),
    )
    if compiled:
        reset_dynamo()
    started = time.perf_counter()
    trainer.train()
    marks = [started, *clock.marks]
    times = [b - a for a, b in itertools.pairwise(marks)]
    timed = times[warmup:] or times
    counts = dynamo_compile_counts() if compiled else {}
    return {
        "steps_per_s": 1.0 / statistics.median(timed),
        "first_steps_s": sum(times[:warmup]),
        "counts": counts,
        "buckets": shape_bucket_count(data.collator, cfg.data.max_length),
        "loss": trainer.state.log_history[-1].get("train_loss"),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=125)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--arms", default="eager,compiled")
    p.add_argument("--override", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    a = p.parse_args(argv)
    overrides = [x for key, value in a.override for x in (f"--{key}", value)]
    results: dict[str, list[dict]] = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for arm in a.arms.split(","):
                res = run_arm(arm == "compiled", a.steps, a.warmup, overrides, os.path.join(tmp, f"{arm}{r}"))
                results[arm].append(res)
                print(
                    f"round={r} arm={arm} steps_per_s={res['steps_per_s']:.3f} warmup_s={res['first_steps_s']:.1f} "
                    f"train_loss={res['loss']:.4f} {' '.join(f'{k}={v}' for k, v in res['counts'].items())}",
                    flush=True,
                )
    eager = statistics.median(r["steps_per_s"] for r in results["eager"]) if results["eager"] else float("nan")
    comp = results["compiled"]
    speed = statistics.median(r["steps_per_s"] for r in comp) if comp else float("nan")
    counts = comp[-1]["counts"] if comp else {}
    buckets = (comp or results["eager"])[-1]["buckets"]
    print(
        f"compiled_vs_eager={speed / eager:.3f} graphs={counts.get('graphs')} recompiles={counts.get('recompiles')} "
        f"most_of_one={counts.get('most_of_one')} graph_breaks={counts.get('graph_breaks')} buckets={buckets}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
