"""2 gloo CPU ranks: a tiny (LoRA) Llama wrapped by torch's FSDP1 (`FullyShardedDataParallel`, run directly: accelerate
refuses FSDP1 on CPU), one backward, then what hf_stable's engine seam and callbacks make of it. Writes
`rank{N}.json` into the directory given as the first argument.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp._flat_param import FlatParameter
from transformers import TrainerControl, TrainerState

from hf_stable.callbacks import build_callbacks
from hf_stable.callbacks.base import StabilityCallback
from hf_stable.config import load_config
from hf_stable.core.engine import StepEngine
from hf_stable.errors import ConfigError

if __package__:  # imported as tests.dist_scripts.fsdp1_refusal
    from tests.dist_scripts.guards_common import tiny_lora_llama, training_args
else:  # launched by torchrun: the script's own directory is on sys.path (no PYTHONPATH in CI)
    from guards_common import tiny_lora_llama, training_args


def _refusal(fn) -> str | None:
    try:
        fn()
    except ConfigError as e:
        return str(e)
    return None


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {}
    for orig in (True, False):
        # flat parameters need one requires_grad per flattened unit: LoRA (frozen base) only with use_orig_params
        base = tiny_lora_llama(lora=orig)
        model = FullyShardedDataParallel(base, device_id=torch.device("cpu"), use_orig_params=orig)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local_sq = float(sum(g.float().pow(2).sum() for g in grads))
        args = training_args(out / "run", max_steps=1)
        callbacks = build_callbacks(load_config(argv=[]), args)
        state = TrainerState()
        state.is_world_process_zero = rank == 0
        report[f"use_orig_params={orig}"] = {
            "flat_params": all(isinstance(p, FlatParameter) for p in model.parameters()),
            "local_grad_sq": local_sq,
            "engine": _refusal(lambda m=model: StepEngine.of(m)),
            "on_train_begin": [
                _refusal(lambda cb=cb, m=model, a=args, s=state: cb.on_train_begin(a, s, TrainerControl(), model=m))
                for cb in callbacks
                if isinstance(cb, StabilityCallback)  # every monitor and guard (not the checkpoint marker)
            ],
        }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
