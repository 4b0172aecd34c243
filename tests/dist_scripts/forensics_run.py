"""A tiny Trainer run with one poisoned record, for the forensics tests (in-process helpers, and a script that
`torchrun` launches for the 2-rank and kill -9 + resume tests).

    python tests/dist_scripts/forensics_run.py OUT [--kill-at N] [--resume] [--packing] [--steps S]
    torchrun --nproc_per_node 2 tests/dist_scripts/forensics_run.py OUT ...

The poison is data-driven and reproducible: a forward hook on the final norm multiplies (or NaNs) the logits at the
positions whose input token is `MAGIC`, and only the poisoned record holds that token, so the record's own loss
is huge (or NaN), the skip guard skips its step, and a re-run of the batch reproduces it - as a garbage record
would. Each rank writes result_rank<r>.json (quarantine, skipped steps) and lora_rank<r>.pt (final LoRA tensors).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

if __package__:  # imported by the tests as tests.dist_scripts.forensics_run
    from tests.dist_scripts.guards_common import tiny_lora_llama, training_args
else:  # launched by torchrun: the script's own directory is on sys.path
    from guards_common import tiny_lora_llama, training_args

from hf_stable.callbacks.guards import SkipGuard
from hf_stable.callbacks.spike_forensics import ForensicsConfig, SpikeForensics
from hf_stable.data.collators import PackingCollator, PaddingCollator
from hf_stable.data.identity import RecordInfo, RecordTable
from hf_stable.trainer import StableTrainer

MAGIC = 127
N, BATCH, SEED = 32, 4, 0
# screening with thresholds so low that every sample is a suspect (8 per decision), re-run for its prompt gain, named:
# exercises the suspects' re-run and its reduce on every rank (the 2-rank test checks the ranks agree)
SCREEN_ALL = {
    "screen": True,
    "screen_every": 4,
    "suspect_zscore": -1e9,
    "suspect_excess_nats": -1e9,
    "prompt_gain_min": 0.0,
}

# the trajectory rule on this 32-record set (population floor lowered to it); with MILD the poisoned record's loss is
# only mildly raised (logits x3 for the loss, not for the gradient): never a culprit of its step, named by its
# trajectory at the end of epoch 1 (the early bar; epoch 2 with the early bar off) (issue 25)
TRAJECTORY = {"screen": True, "screen_every": 4, "trajectory_min_population": 16}
MILD = {"factor": 3.0, "grad_free": True}


def rows(poison_index: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(N):
        length = int(torch.randint(8, 14, (1,), generator=g))
        start = int(torch.randint(0, 120, (1,), generator=g))
        ids = ((start + torch.arange(length)) % 120).tolist()
        if k == poison_index:
            ids = [ids[0]] + [MAGIC] * (length - 1)
        out.append({"input_ids": ids, "labels": [-100, -100] + ids[2:], "record_id": k})
    return out


def position_of(step: int, slot: int = 1, world: int = 1) -> int:
    """The dataset index the quarantine sampler yields at `slot` of 1-based `step` in epoch 0 (one process)."""
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    return perm[(step - 1) * BATCH * world + slot]


def poison(model, factor: float, grad_free: bool = False) -> None:
    """`grad_free`: the loss sees the scaled logits, the gradient the unscaled ones (a high loss without a gradient
    spike: too mild for the skip guard, a case for screening).

    The hook is on the body's final norm: the head is a bias-free linear map, so scaling a position's hidden state
    scales its logits, and the poison reaches the chunked training loss (which calls the head on selected rows,
    not on ``[B, T, H]``) and the model's own forward alike."""
    seen = {}
    model.register_forward_pre_hook(lambda m, a, kw: seen.update(ids=kw.get("input_ids")), with_kwargs=True)

    def hook(module, args, out):
        ids = seen.get("ids")
        if ids is None or ids.shape != out.shape[:-1]:
            return out
        hit = (ids == MAGIC)[..., None]
        if grad_free:
            bad = out + out.detach() * (factor - 1)
        else:
            bad = out * factor if math.isfinite(factor) else torch.full_like(out, factor)
        return torch.where(hit, bad, out)

    model.base_model.model.model.norm.register_forward_hook(hook)


def table() -> RecordTable:
    return RecordTable([RecordInfo(f"train.jsonl:{k + 1}", f"h{k:02d}", f"row {k}") for k in range(N)])


class KillAfterSave(TrainerCallback):
    """SIGKILL (kill -9) this process right after checkpoint-N is completely written."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kw):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def build(
    out,
    *,
    packing=False,
    factor=float("nan"),
    mode="auto",
    steps=16,
    poison_index=None,
    callbacks=(),
    forensics_kw=None,
    grad_free=False,
    guards=None,
    **train_kw,
):
    """(trainer, skip guard, forensics) of the poisoned run."""
    from datasets import Dataset

    idx = position_of(6) if poison_index is None else poison_index
    ds = Dataset.from_list(rows(idx))
    collator = (
        PackingCollator(0, max_row_tokens=28, return_record_ids=True)
        if packing
        else PaddingCollator(0, return_record_ids=True)
    )
    model = tiny_lora_llama()
    poison(model, factor, grad_free)
    guards = guards if guards is not None else [SkipGuard(window=20, warmup_steps=3)]
    skip = next(g for g in guards if isinstance(g, SkipGuard))
    forensics = SpikeForensics(ForensicsConfig(quarantine=mode, **(forensics_kw or {})), table()).attach(guards)
    args = training_args(
        out,
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        remove_unused_columns=False,
        learning_rate=1e-3,
        **train_kw,
    )
    trainer = StableTrainer(
        model=model, args=args, train_dataset=ds, data_collator=collator, callbacks=[*guards, forensics, *callbacks]
    )
    return trainer, skip, forensics


def run_script(out, *args, check=True):
    """This script in a subprocess (one process), as the tests launch it; fails on a non-zero exit with `check`."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), str(out), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read_result(out, r=0):
    """(result_rank<r>.json, lora_rank<r>.pt) of a run of this script."""
    return json.loads((Path(out) / f"result_rank{r}.json").read_text()), torch.load(Path(out) / f"lora_rank{r}.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--poison-index", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--screen", action="store_true", help="screening: every sample a suspect (SCREEN_ALL)")
    p.add_argument("--engine", default="ddp", help="ddp, zero1/2/3 or fsdp2 (tests/dist_scripts/engines.py)")
    p.add_argument("--trajectory", action="store_true", help="the mild poison, screening + trajectories")
    a = p.parse_args()
    engine_kw = {}
    if a.engine != "ddp":
        import fsdp_cpu
        from engines import engine_args

        fsdp_cpu.enable()
        engine_kw = engine_args(a.engine)
    out = Path(a.out)
    callbacks = [KillAfterSave(a.kill_at)] if a.kill_at else []
    trainer, skip, forensics = build(
        out,
        packing=a.packing,
        steps=a.steps,
        poison_index=a.poison_index,
        callbacks=callbacks,
        forensics_kw=TRAJECTORY if a.trajectory else SCREEN_ALL if a.screen else None,
        **(MILD if a.trajectory else {}),
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        **engine_kw,
    )
    resume = None
    if a.resume:
        from transformers.trainer_utils import get_last_checkpoint

        resume = get_last_checkpoint(str(out))
    trainer.train(resume_from_checkpoint=resume)
    r = int(os.environ.get("RANK", "0"))
    if a.engine == "ddp":
        lora = {n: t.detach().clone() for n, t in trainer.model.named_parameters() if "lora_" in n}
    else:  # the full tensors, gathered from the ranks' parts
        from engines import full_weights

        names = [n for n, t in trainer.model.named_parameters() if t.requires_grad]
        lora = dict(zip(names, full_weights(trainer.model), strict=True))
    torch.save(lora, out / f"lora_rank{r}.pt")
    (out / f"result_rank{r}.json").write_text(
        json.dumps(
            {
                "quarantine": forensics.quarantine.state_dict(),
                "skipped": skip.skipped_steps,
                "resumed_from": resume,
                "global_step": trainer.state.global_step,
                "trajectory": forensics.trajectory.state_dict() if forensics.trajectory is not None else None,
            }
        )
    )
    from hf_stable.distributed import shutdown

    shutdown()
    # Results are on disk. Skip interpreter finalisation as the other 2-rank scripts do (guards_ddp.py): a gloo
    # thread can still abort the process there ("terminate called without an active exception"; CI hit it twice
    # in one run of this script, 0 in 44 runs here), which would fail a correct run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
