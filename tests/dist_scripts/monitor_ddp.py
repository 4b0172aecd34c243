"""Two-rank DDP run (gloo, CPU) with every monitor on; each rank writes its metrics and events to OUT/rank<i>.json.

Launched by tests/test_monitor_ddp.py as `torchrun --nproc_per_node 2 monitor_ddp.py OUT`. Rank 1 alone poisons
one gradient at step 3 (a tensor hook): after DDP's all-reduce both ranks hold NaN gradients, and both must name
the same parameter although only rank 1's re-run can see where the NaN came from.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_stable.callbacks.monitors import build_monitors
from hf_stable.config import MonitorsConfig
from hf_stable.distributed import shutdown

POISONED = "model.layers.1.mlp.down_proj.weight"
PREFIXES = ("grad/", "loss/", "update/", "mem/", "perf/", "hw/")


class PoisonOnRank(TrainerCallback):
    def __init__(self, param, rank: int, at_step: int):
        self.param, self.rank, self.at_step, self.handle = param, rank, at_step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if args.process_index == self.rank and state.global_step + 1 == self.at_step:
            self.handle = self.param.register_hook(lambda g: torch.full_like(g, float("nan")))

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def main(out: str) -> None:
    # A hang (a collective one rank skipped) must end with stack traces, not an orphaned process.
    faulthandler.dump_traceback_later(int(os.environ.get("MONITOR_DDP_TIMEOUT", "200")), exit=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": (ids := torch.randint(0, 256, (16,), generator=g)), "labels": ids.clone()} for _ in range(64)
    ]
    cfg = MonitorsConfig()
    cfg.update.every_n_steps = 1
    cfg.memory.every_n_steps = 1
    monitors = build_monitors(cfg)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=5,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_grad_norm=0.0,
        learning_rate=1e-3,
        seed=0,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
    )
    target = dict(model.named_parameters())[POISONED]
    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[*monitors, PoisonOnRank(target, rank=1, at_step=3)]
    )
    trainer.train()
    history = [
        {k: v for k, v in h.items() if k == "step" or k.startswith(PREFIXES) or k == "loss"}
        for h in trainer.state.log_history
        if any(k.startswith(PREFIXES) for k in h)
    ]
    events = [{k: v for k, v in e.items() if k != "time"} for cb in monitors for e in cb.events]
    result = {"world_size": args.world_size, "history": history, "events": events}
    Path(out, f"rank{args.process_index}.json").write_text(json.dumps(result, default=str))
    shutdown()  # leave together: a gloo rank whose peer already exited can abort at interpreter shutdown
    # Results are on disk. Skip interpreter finalisation: torch's gloo teardown at exit sometimes aborts
    # ("terminate called without an active exception", ~1 run in 10 here), which would fail a correct run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
