"""Seeded fault fuzz on two gloo ranks: the recipe's trainer and default callbacks must survive faults on one rank.

    torchrun --nproc_per_node 2 tests/dist_scripts/fault_fuzz.py OUT [--seeds 20] [--first-seed 0] [--steps 30]

One process group for every seed (a collective timeout turns a hang into an error); per seed a fresh tiny LoRA
Llama, `StableTrainer` and `build_callbacks(RunConfig())` (skip, rollback with verify, clipping, monitors, the
non-finite locator), and 2-5 faults drawn from the seed: a step, a kind and a rank (0, 1 or both):

* `nan_grad`   one element of a random gradient tensor set to NaN *after* DDP's all-reduce (this rank only);
* `spike`      one random gradient tensor, or all of them, x1e4 after the all-reduce (this rank only);
* `nan_loss`   the training loss x NaN (forward hook): DDP spreads NaN to both ranks' gradients;
* `garbage`    the batch's token ids replaced by random ones (forward pre-hook), labels too: a loss spike.

Some seeds repeat a fault on the same rank a few steps later, inside every alert cooldown (the pattern that made the
non-finite locator enter a collective alone). Seed 0 is the exact case of issue 13: rank 1 alone gets a NaN
gradient at step 7, then rank 1 alone a NaN loss at step 12.

The injector is a callback listed first, so it edits gradients before the guards judge them (and invalidates the
shared gradient statistics it changed). Each rank appends one
JSON line per seed to OUT/rank<r>.jsonl: the plan, whether every trainable weight is finite, a SHA-256 of the
trainable weights (bitwise identity across ranks), and every hf_stable callback's events without their time. Rank 0
prints one line per seed comparing the two ranks; the exit code is 1 when any seed differs or is not finite.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from guards_common import VOCAB, _trainer_forward, tiny_lora_llama, token_data, training_args

from hf_stable.callbacks import StabilityCallback, build_callbacks
from hf_stable.config import RunConfig
from hf_stable.core import GradStats
from hf_stable.distributed import broadcast_object, shutdown
from hf_stable.trainer import StableTrainer

KINDS = ("nan_grad", "spike", "nan_loss", "garbage")
ISSUE_13 = [(7, "nan_grad", 1), (12, "nan_loss", 1)]


def plan(seed: int, steps: int) -> list[tuple[int, str, int | str]]:
    """[(step, kind, rank or "both")], the same on every rank."""
    if seed == 0:
        return list(ISSUE_13)
    rng = random.Random(seed)
    faults = [
        (rng.randint(1, steps), rng.choice(KINDS), rng.choice([0, 1, 1, "both"])) for _ in range(rng.randint(2, 4))
    ]
    if rng.random() < 0.5:  # the same rank again a few steps later: inside every cooldown
        step, _, who = rng.choice(faults)
        faults.append((min(steps, step + rng.randint(1, 6)), rng.choice(KINDS), who))
    return sorted(faults, key=lambda f: (f[0], str(f[2])))


class FaultInjector(StabilityCallback):
    """Applies the plan on this rank: gradient faults in `on_pre_optimizer_step` (listed first: before every guard),
    data faults through hooks on the model. A StabilityCallback only so that it keeps its first place however the
    callbacks get ordered; it writes no events."""

    def __init__(self, model, faults, seed: int, rank: int):
        super().__init__()
        self.rank, self.seed = rank, seed
        self.faults: dict[int, list[str]] = {}
        for step, kind, who in faults:
            if who in (rank, "both"):
                self.faults.setdefault(step, []).append(kind)
        self.step = 0
        model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        model.register_forward_hook(self._post_hook)

    @property
    def state_key(self) -> str:
        return "FaultInjector"

    def _rng(self, salt: int) -> random.Random:
        return random.Random(self.seed * 100_003 + self.step * 101 + self.rank * 7 + salt)

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self.step = state.global_step + 1

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        kinds = self.faults.get(state.global_step + 1, [])
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        rng = self._rng(1)
        with torch.no_grad():
            if "nan_grad" in kinds:
                g = rng.choice(grads)
                g.view(-1)[rng.randrange(g.numel())] = float("nan")
            if "spike" in kinds:
                for g in grads if rng.random() < 0.5 else [rng.choice(grads)]:
                    g.mul_(1e4)
        if kinds:
            # StableTrainer takes the shared statistics in its clip step, before the callbacks: a callback that edits
            # gradients in place says so, until the statistics notice it themselves (issue 13, item 2)
            GradStats.shared(model).invalidate()

    def _pre_hook(self, module, args, kwargs):
        if "garbage" in self.faults.get(self.step, []) and _trainer_forward(module):
            ids = kwargs["input_ids"]
            g = torch.Generator().manual_seed(self._rng(2).randrange(2**31))
            garbage = torch.randint(0, VOCAB, ids.shape, generator=g).to(ids.device)
            return args, {**kwargs, "input_ids": garbage, "labels": garbage.clone()}
        return None

    def _post_hook(self, module, args, output):
        if "nan_loss" in self.faults.get(self.step, []) and _trainer_forward(module):
            output["loss"] = output["loss"] * float("nan")
            return output
        return None


def weights_digest(model) -> tuple[str, bool]:
    h, finite = hashlib.sha256(), True
    for name, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
        w = p.detach().cpu().contiguous()
        finite = finite and bool(torch.isfinite(w).all())
        h.update(name.encode())
        h.update(w.numpy().tobytes())
    return h.hexdigest(), finite


def _events_text(record: dict) -> str:
    return json.dumps(record["events"], sort_keys=True)  # NaN != NaN: compare the text


def run_seed(seed: int, steps: int, out: Path, rank: int) -> dict:
    faults = plan(seed, steps)
    model = tiny_lora_llama(seed=0)
    injector = FaultInjector(model, faults, seed, rank)
    args = training_args(
        out / f"seed{seed}", max_steps=steps, per_device_train_batch_size=2, logging_steps=5, ddp_timeout=60
    )
    callbacks = [injector, *build_callbacks(RunConfig(), args)]
    trainer = StableTrainer(
        model=model, args=args, train_dataset=token_data(4 * steps, seed=seed + 1), callbacks=callbacks
    )
    start = time.perf_counter()
    trainer.train()
    digest, finite = weights_digest(model)
    ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StabilityCallback)]
    events = {cb.state_key: [{k: v for k, v in e.items() if k != "time"} for e in cb.events] for cb in ours}
    return {
        "seed": seed,
        "rank": rank,
        "faults": faults,
        "steps": trainer.state.global_step,
        "finite": finite,
        "weights": digest,
        "events": events,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--collective-timeout", type=int, default=60, help="seconds before a hung collective fails")
    opts = parser.parse_args()
    # a last resort if even the collective timeout does not fire: stacks of every thread, then exit
    faulthandler.dump_traceback_later(opts.collective_timeout + 30 * opts.seeds, exit=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts.collective_timeout))
    rank = dist.get_rank()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    failures = 0
    with open(out / f"rank{rank}.jsonl", "w", encoding="utf-8") as log:
        for seed in range(opts.first_seed, opts.first_seed + opts.seeds):
            record = run_seed(seed, opts.steps, out, rank)
            log.write(json.dumps(record) + "\n")
            log.flush()
            other = broadcast_object(record, src=1)  # rank 1's record on rank 0
            same = other["weights"] == record["weights"] and _events_text(other) == _events_text(record)
            ok = same and record["finite"] and other["finite"] and record["steps"] == opts.steps
            failures += not ok
            if rank == 0:  # on stderr: the test shows it when the launch fails
                kinds = sum(len(v) for v in record["events"].values())
                print(
                    f"seed {seed}: {'ok' if ok else 'FAILED'} (faults {record['faults']}, {kinds} events, "
                    f"finite {record['finite']}/{other['finite']}, ranks identical {same}, {record['seconds']}s)",
                    file=sys.stderr,
                    flush=True,
                )
    if rank == 0:
        print(f"{opts.seeds - failures}/{opts.seeds} seeds ok", file=sys.stderr, flush=True)
    shutdown()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
