"""Rescue benchmark: seeded stress cases, the plain Trainer (its default clipping) vs hf_stable's default guards.

    python benchmarks/rescue.py [--seeds 0 1 2] [--steps 150] [--cases lr_10x nan spikes poison] [--threads 1]

Setup (CPU, offline, ~2 minutes on 2 shared cores): a 4-layer Llama (hidden 64) is pretrained briefly on a synthetic
Markov language (table A), then LoRA-fine-tuned (r=8, all linear layers, AdamW, cosine schedule with warmup) on a
shifted language (half of the transition rows re-drawn). Both methods see the same base, data, seeds and steps.

Stress cases (each x every seed):

* `lr_10x`   the learning rate 10x the clean one.
* `nan`      the loss is NaN at 3 random steps (so are the gradients).
* `spikes`   the loss is x1e3 at 3 random steps (gradients x1e3).
* `poison`   2 batches replaced by garbage tokens (uniform random ids, fully supervised).
* `poison_burst`  10 consecutive garbage batches (a corrupted shard): bad data, not damaged weights - the rollback
             guard must tell the two apart (`rollback_check`) instead of undoing good steps and cutting the LR.

`plain` is `Trainer` with `max_grad_norm=1.0`; `hf_stable` is `Trainer` with `max_grad_norm=0` and
`build_guards(GuardsConfig())` (skip + rollback + adaptive clipping). The reference is the plain Trainer's clean
run of the same seed. Columns: eval losses, their ratio to the reference, the verdicts, and for hf_stable the
skipped steps, rollbacks and the final LR factor (rollback backoff). A run is *ok* when its final eval loss is
finite and within 5 % of that reference; *diverged* when it is non-finite or worse than the base before
fine-tuning; *degraded* in between. A case the plain Trainer survives is reported as `survived` — the baseline
did not fail there, so it is not a rescue.

Measured (2 CPU cores, idle, 150 s): plain_failed=7/15 hf_stable_ok=15/15. NaN: plain ends NaN, hf_stable within
0.4 %. LR 10x: plain diverges (eval 4.5-4.6 vs 1.49); hf_stable rolls back twice (the second, after a recovery,
escalates the backoff to 0.25: LR factor 0.125) and ends within 1.0 %. Spikes and one poisoned batch: the plain
Trainer's clipping absorbs them here (reported as survived); hf_stable skips them at no cost. Burst of 10 garbage
batches: plain 2.9-9.0 % worse; hf_stable skips all ten, the rollback check finds the batches as bad at the
snapshot's weights and declines the rollback: within 0.6 % (before that check: 1 rollback, 4.8-6.6 % worse).

Last line (machine-readable): `plain_failed=<n>/<N> hf_stable_ok=<m>/<N>` over the N stress runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import math
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_STABLE_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

VOCAB, LENGTH, BATCH = 128, 32, 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CLEAN_LR = 1e-2  # the best of 3e-3 / 1e-2 / 3e-2 on the clean task: "10x too high" is measured from a tuned LR
CASES = ("lr_10x", "nan", "spikes", "poison", "poison_burst")
BURST = 10  # consecutive garbage batches in `poison_burst`
TOLERANCE = 0.05


# --- data and model ---------------------------------------------------------------------------------------------
def markov_rows(n: int, seed: int, remap: float = 0.0) -> list[dict]:
    """Sequences from a fixed sparse Markov chain (4 successors per token, p = .6/.2/.1/.1); `remap` re-draws that
    fraction of the transition rows (the fine-tuning language)."""
    g = torch.Generator().manual_seed(1234)
    table = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    if remap:
        rows = torch.randperm(VOCAB, generator=g)[: int(remap * VOCAB)]
        table[rows] = torch.randint(0, VOCAB, (len(rows), 4), generator=g)
    probs = torch.tensor([0.6, 0.2, 0.1, 0.1])
    gs = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n,), generator=gs)
    picks = torch.multinomial(probs.expand(n * LENGTH, 4), 1, replacement=True, generator=gs).view(n, LENGTH)
    out = torch.empty(n, LENGTH, dtype=torch.long)
    out[:, 0] = starts
    for t in range(1, LENGTH):
        out[:, t] = table[out[:, t - 1], picks[:, t]]
    return [{"input_ids": row, "labels": row.clone()} for row in out]


def _quiet():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    logging.getLogger("hf_stable").setLevel(logging.CRITICAL)  # events are counted in the table instead


def _args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=BATCH, per_device_eval_batch_size=64, report_to=[],
                use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=10**6, dataloader_num_workers=0,
                lr_scheduler_type="cosine", warmup_steps=5)
    base.update(kw)
    return TrainingArguments(**base)


def pretrain_base(steps: int = 250):
    """The shared base: a 4-layer Llama trained on language A (full fine-tune)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH)
    base = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        args = _args(tmp, per_device_train_batch_size=16, max_steps=steps, learning_rate=3e-3, seed=0,
                     warmup_steps=10)
        Trainer(model=base, args=args, train_dataset=markov_rows(steps * 16, seed=5)).train()
    return base


# --- faults -----------------------------------------------------------------------------------------------------
class Faults:
    """Forward hooks that corrupt chosen training steps (1-based; one forward per step)."""

    def __init__(self, model, case: str, steps: int, seed: int):
        rng = random.Random(1000 + seed)
        window = range(10, steps - 10)
        self.case = case
        count = {"nan": 3, "spikes": 3, "poison": 2}.get(case, 0)
        self.at = set(rng.sample(window, count)) if count else set()
        if case == "poison_burst":
            start = rng.randrange(20, steps - BURST - 20)
            self.at = set(range(start, start + BURST))
        self.forwards = 0
        self.gen = torch.Generator().manual_seed(seed)
        if self.at:
            model.register_forward_pre_hook(self._pre, with_kwargs=True)
            model.register_forward_hook(self._post)

    def _training(self, module) -> bool:
        """The Trainer's own forwards only: hf_stable's re-runs (locator, rollback probe) pause the StepTap."""
        from hf_stable.callbacks.step_tap import StepTap

        return module.training and torch.is_grad_enabled() and not StepTap.shared(module)._paused

    def _pre(self, module, args, kwargs):
        if not self._training(module):
            return None
        self.forwards += 1
        if self.case in ("poison", "poison_burst") and self.forwards in self.at:
            ids = kwargs["input_ids"]
            garbage = torch.randint(0, VOCAB, ids.shape, generator=self.gen).to(ids.device)
            kwargs["input_ids"], kwargs["labels"] = garbage, garbage.clone()
            return args, kwargs
        return None

    def _post(self, module, args, output):
        if self._training(module) and self.forwards in self.at and self.case in ("nan", "spikes"):
            output["loss"] = output["loss"] * (float("nan") if self.case == "nan" else 1e3)
            return output
        return None


# --- one run ---------------------------------------------------------------------------------------------------------
def run(base, method: str, case: str, seed: int, steps: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer

    from hf_stable.callbacks.guards import build_guards, guard_training_overrides
    from hf_stable.config.guards import GuardsConfig

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    faults = Faults(model, case, steps, seed)
    lr = CLEAN_LR * (10 if case == "lr_10x" else 1)
    callbacks, extra = [], {"max_grad_norm": 1.0}
    if method == "hf_stable":
        cfg = GuardsConfig()
        callbacks = build_guards(cfg)
        extra = guard_training_overrides(cfg, {}, warn=False)
    train = markov_rows(steps * BATCH, seed=100 + seed, remap=0.5)
    evals = markov_rows(128, seed=999, remap=0.5)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        args = _args(tmp, max_steps=steps, learning_rate=lr, seed=seed, **extra)
        trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals, callbacks=callbacks)
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    events = [e["kind"] for cb in callbacks for e in getattr(cb, "events", [])]
    lr_factor = next((cb.product for cb in callbacks if type(cb).__name__ == "LRControl"), 1.0)
    weights_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)
    if not weights_finite:
        eval_loss = float("nan")
    return {"eval_loss": eval_loss, "seconds": time.perf_counter() - started, "faults": sorted(faults.at),
            "skips": events.count("step_skipped"), "rollbacks": events.count("rollback"), "lr_factor": lr_factor}


def base_eval_loss(base) -> float:
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(model=copy.deepcopy(base), args=_args(tmp), eval_dataset=markov_rows(128, 999, remap=0.5))
        return trainer.evaluate()["eval_loss"]


def _fmt(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "nan"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _quiet()
    t0 = time.perf_counter()
    base = pretrain_base()
    before = base_eval_loss(base)
    print(f"base eval loss before fine-tuning: {before:.3f}  (pretraining {time.perf_counter() - t0:.1f}s)")
    header = (f"{'case':<12} {'seed':>4} {'plain':>7} {'hf_stable':>9} {'ref':>6} {'plain_vs_ref':>12} "
              f"{'hf_vs_ref':>9} {'plain':>9} {'hf_stable':>9} {'skips':>5} {'rollb':>5} {'lr_fac':>6}")
    rows, plain_failed, hf_ok, n = [], 0, 0, 0
    for seed in opts.seeds:
        ref = run(base, "plain", "clean", seed, opts.steps)["eval_loss"]
        hf_clean = run(base, "hf_stable", "clean", seed, opts.steps)
        rows.append(("clean", seed, ref, hf_clean["eval_loss"], ref, hf_clean, None, None))
        for case in opts.cases:
            plain = run(base, "plain", case, seed, opts.steps)
            ours = run(base, "hf_stable", case, seed, opts.steps)

            def ok(x):
                return math.isfinite(x) and x <= ref * (1 + TOLERANCE)

            def verdict(x):
                if not math.isfinite(x) or x > before:
                    return "diverged"
                return "ok" if ok(x) else "degraded"

            n += 1
            plain_failed += not ok(plain["eval_loss"])
            hf_ok += ok(ours["eval_loss"])
            rows.append((case, seed, plain["eval_loss"], ours["eval_loss"], ref, ours,
                         verdict(plain["eval_loss"]), verdict(ours["eval_loss"])))
            print(f"  {case} seed {seed}: plain {_fmt(plain['eval_loss'])} hf_stable {_fmt(ours['eval_loss'])} "
                  f"(ref {ref:.3f}; {plain['seconds'] + ours['seconds']:.1f}s)", flush=True)
    print()
    print(header)
    for case, seed, p, h, ref, ours, vp, vh in rows:
        ratio = (lambda x: f"{x / ref:.3f}" if math.isfinite(x) else "nan")
        vp = vp or "-"
        vh = vh or "-"
        if vp == "ok":
            vp = "survived"
        print(f"{case:<12} {seed:>4} {_fmt(p):>7} {_fmt(h):>9} {ref:>6.3f} {ratio(p):>12} {ratio(h):>9} {vp:>9} "
              f"{vh:>9} {ours['skips']:>5} {ours['rollbacks']:>5} {ours['lr_factor']:>6.3g}")
    survived = [(c, s) for c, s, _, _, _, _, vp, _ in rows if vp == "ok"]
    if survived:
        print(f"baseline survived (not a rescue): {', '.join(f'{c}/seed{s}' for c, s in survived)}")
    print(f"total {time.perf_counter() - t0:.0f}s")
    print(f"plain_failed={plain_failed}/{n} hf_stable_ok={hf_ok}/{n}")


if __name__ == "__main__":
    main()
