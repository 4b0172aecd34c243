"""torchrun worker of the rescue benchmark's DDP cases: every requested run on 2 gloo ranks, one process group.

    torchrun --nproc_per_node 2 benchmarks/rescue_ddp.py SPEC.json

SPEC: {"base_dir", "steps", "runs": [[case, arm, seed], ...], "out", "engine" (optional: ddp, zero1/2/3, fsdp2)}. Each run's result (rank 0's) is
appended to `out` as a JSON line, with `ranks_identical`: whether both ranks end with bitwise equal trainable
weights (a run whose ranks split does not count as ok).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("HF_STABLE_LOG_LEVEL", "CRITICAL")


def main(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    from rescue_cases import CASES
    from rescue_harness import run_one
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from hf_stable.distributed import shutdown

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    faulthandler.dump_traceback_later(int(spec.get("timeout", 1500)), exit=True)
    base = LlamaForCausalLM.from_pretrained(spec["base_dir"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    engine = spec.get("engine", "ddp")
    overrides, full = None, None
    if engine != "ddp":  # the engines of tests/dist_scripts (FSDP2 on CPU needs its test-only switch)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dist_scripts"))
        import fsdp_cpu
        from engines import engine_args, full_weights

        fsdp_cpu.enable()
        overrides, full = engine_args(engine), full_weights
    for case, arm, seed in spec["runs"]:
        result = run_one(
            base,
            CASES[case],
            arm,
            seed,
            spec["steps"],
            world=world,
            rank=rank,
            engine_overrides=overrides,
            full_weights=full,
        )
        result["engine"] = engine
        digests = [None] * world
        dist.all_gather_object(digests, result["digest"])
        result["ranks_identical"] = len(set(digests)) == 1
        if rank == 0:
            with open(spec["out"], "a") as f:
                f.write(json.dumps(result) + "\n")
    shutdown()
    # Results are on disk; skip interpreter finalisation (gloo teardown at exit sometimes aborts, see tests).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
