"""Guard stress check: faults injected from outside hf_stable, the plain Trainer vs the stock Trainer and
`StableTrainer`, both with `build_callbacks` (every default monitor and guard).

    python benchmarks/guard_faults.py [--steps 150] [--seeds 0] [--cases clean nan_grad spike fwd_overflow]

Setup (CPU, offline): a tiny Qwen3 (hidden 64, 2 layers, vocab 128) from random init, fully fine-tuned (no LoRA,
AdamW, cosine schedule) on a synthetic Markov language; eval loss on held-out rows of the same language.

Faults, at seeded random steps:

* `nan_grad`     5 steps: NaN written into one element of one random gradient by a callback that runs first in
                 `on_pre_optimizer_step` (after the Trainer's own clip step: `StableTrainer` has taken its gradient
                 statistics by then);
* `spike`        3 steps: every gradient x1e4, by the same callback;
* `fwd_overflow` 5 steps: the first decoder layer's MLP output overflows (x inf) inside the forward, so the loss and
                 every gradient are NaN;
* `damage`       5 steps: the weights are damaged after the update (the LM head x NaN, as an overflowing update
                 would), so the following steps are bad until a rollback. It measures what a rollback costs: the
                 steps it undoes as a share of the steps done (`undone`, `worst share`).

The fault callback is a `StabilityCallback` listed first, so it keeps its place in front of hf_stable's callbacks
(which the handler moves right after `DefaultFlowCallback`). `plain` is `Trainer` with `max_grad_norm=1.0` and no
callbacks but the fault; `stock` and `stable` use the recipe's overrides (`max_grad_norm=0`, hf_stable clips).

Last line (machine-readable): `rescued=<n>/<N>` over the fault runs of `stock` and `stable` whose eval loss is finite
and within 10 % of the clean run of the same trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import random
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("HF_STABLE_LOG_LEVEL", "ERROR")

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rescue import _quiet
from rescue_cases import LENGTH, VOCAB, markov_ids, rows

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.compat import foreach_mul_

CASES = ("clean", "nan_grad", "spike", "fwd_overflow", "damage")
METHODS = ("plain", "stock", "stable")
COUNTS = {"nan_grad": 5, "spike": 3, "fwd_overflow": 5, "damage": 5}
BATCH = 8
TOLERANCE = 0.10


class GradFault(StabilityCallback):
    """Edits `p.grad` in `on_pre_optimizer_step` at the chosen 1-based steps (list it first)."""

    def __init__(self, case: str, steps: set[int], seed: int):
        super().__init__()
        self.case, self.steps, self.rng = case, steps, random.Random(seed)

    @property
    def state_key(self) -> str:
        return "GradFault"

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 not in self.steps:
            return
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        with torch.no_grad():
            if self.case == "nan_grad":
                g = grads[self.rng.randrange(len(grads))]
                g.view(-1)[self.rng.randrange(g.numel())] = float("nan")
            elif self.case == "spike":
                foreach_mul_(grads, 1e4)


class WeightDamage(TrainerCallback):
    """The LM head x NaN after the update of the chosen steps (a plain callback: it runs after the rollback guard's
    snapshot of that step, so the damage is what the next steps see)."""

    def __init__(self, model, steps: set[int]):
        self.model, self.steps = model, steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            with torch.no_grad():
                self.model.lm_head.weight.mul_(float("nan"))


class ForwardOverflow:
    """The first decoder layer's MLP output x inf at the chosen Trainer forwards (one forward per step)."""

    def __init__(self, model, steps: set[int]):
        from hf_stable.core.step_tap import StepTap

        self.steps, self.forwards, self.tap = steps, 0, StepTap.shared(model)
        model.register_forward_pre_hook(self._count)
        model.model.layers[0].mlp.register_forward_hook(self._overflow)

    def _training(self, module) -> bool:
        return module.training and torch.is_grad_enabled() and not self.tap._paused

    def _count(self, module, args):
        if self._training(module):
            self.forwards += 1

    def _overflow(self, module, args, output):
        if self._training(module) and self.forwards in self.steps:
            return output * float("inf")
        return None


def tiny_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=LENGTH,
    )
    return Qwen3ForCausalLM(config)


def run(method: str, case: str, seed: int, steps: int, lr: float) -> dict:
    from transformers import Trainer, TrainingArguments

    from hf_stable.callbacks import build_callbacks
    from hf_stable.callbacks.guards import guard_training_overrides
    from hf_stable.config import config_from_dict
    from hf_stable.trainer import StableTrainer

    model = tiny_qwen3(seed)
    rng = random.Random(1000 + seed)
    at = set(rng.sample(range(10, steps - 10), COUNTS[case])) if case in COUNTS else set()
    callbacks: list = [GradFault(case, at, seed)] if case in ("nan_grad", "spike") else []
    if case == "fwd_overflow":
        ForwardOverflow(model, at)
    late = [WeightDamage(model, at)] if case == "damage" else []
    cfg = config_from_dict({})
    extra: dict = {"max_grad_norm": 1.0}
    if method != "plain":
        callbacks += build_callbacks(cfg)
        extra = guard_training_overrides(cfg.stability.guards, {}, warn=False)
    train = rows(markov_ids(steps * BATCH, seed=100 + seed, table_seed=1234))
    evals = rows(markov_ids(128, seed=999, table_seed=1234))
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=BATCH,
            per_device_eval_batch_size=64,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10,
            dataloader_num_workers=0,
            lr_scheduler_type="cosine",
            warmup_steps=5,
            max_steps=steps,
            learning_rate=lr,
            seed=seed,
            **extra,
        )
        cls = StableTrainer if method == "stable" else Trainer
        trainer = cls(model=model, args=args, train_dataset=train, eval_dataset=evals, callbacks=callbacks + late)
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        eval_loss = float("nan")
    kinds = [e["kind"] for cb in callbacks for e in getattr(cb, "events", [])]
    skipped = [e for cb in callbacks for e in getattr(cb, "events", []) if e["kind"] == "step_skipped"]
    reasons: dict[str, int] = {}
    for e in skipped:
        for r in e.get("reasons", []):
            reasons[r] = reasons.get(r, 0) + 1
    events = [e for cb in callbacks for e in getattr(cb, "events", [])]
    rollbacks = [(e["step"], e["value"]) for e in events if e["kind"] == "rollback"]
    undone = [step - snap for step, snap in rollbacks]
    return {
        "eval_loss": eval_loss,
        "faults": sorted(at),
        "skips": len(skipped),
        "reasons": reasons,
        "rollbacks": kinds.count("rollback"),
        "declined": kinds.count("rollback_declined"),
        "resets": kinds.count("skip_reference_reset"),
        "undone": undone,
        "worst_share": max((u / step for u, (step, _) in zip(undone, rollbacks, strict=False)), default=0.0),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    _quiet()
    warnings.filterwarnings("ignore")
    results = {}
    for seed in opts.seeds:
        for method in opts.methods:
            for case in ["clean", *[c for c in opts.cases if c != "clean"]]:
                r = results[(seed, method, case)] = run(method, case, seed, opts.steps, opts.lr)
                loss = f"{r['eval_loss']:.3f}" if math.isfinite(r["eval_loss"]) else "nan"
                print(
                    f"seed {seed} {method:<6} {case:<12} eval {loss:>6}  faults {r['faults']}  skips {r['skips']} "
                    f"{r['reasons']}  rollbacks {r['rollbacks']} (undone {r['undone']})  declined "
                    f"{r['declined']}  reference resets {r['resets']}  worst share undone {r['worst_share']:.2f}",
                    flush=True,
                )
    ok = n = 0
    for (seed, method, case), r in results.items():
        if method == "plain" or case == "clean":
            continue
        ref = results[(seed, method, "clean")]["eval_loss"]
        n += 1
        ok += math.isfinite(r["eval_loss"]) and r["eval_loss"] <= ref * (1 + TOLERANCE)
    print(f"rescued={ok}/{n}")


if __name__ == "__main__":
    main()
