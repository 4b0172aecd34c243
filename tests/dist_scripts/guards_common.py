"""Shared pieces of the guard tests, the 2-rank guard script and the rescue benchmark: a tiny LoRA Llama, a
deterministic token dataset, fault injectors, and a recorder of weights / optimizer state / LRs per step.

Kept free of pytest so `torchrun` scripts and `benchmarks/rescue.py` can import it too.
"""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from hf_stable.callbacks.base import StabilityCallback

VOCAB = 128
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def tiny_lora_llama(seed: int = 0, layers: int = 2, hidden: int = 32, lora: bool = True):
    """A from-config Llama (hidden 32, 2 layers) with a rank-4 LoRA adapter; the same weights for the same seed."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False gives LoRA B a non-zero start, so every factor has a gradient from step 1.
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))


def token_data(n: int = 64, length: int = 16, seed: int = 1, masked: bool = True) -> list[dict]:
    """Sequences of a learnable pattern (each token = previous + 1 mod VOCAB, random starts); with `masked`, a
    random-length prefix of each row is -100 in the labels so rows supervise different token counts."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        ids = (start + torch.arange(length)) % VOCAB
        labels = ids.clone()
        if masked:
            labels[: int(torch.randint(0, length - 2, (1,), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def training_args(out, **kw) -> TrainingArguments:
    base = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "max_steps": 12,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "max_grad_norm": 0.0,
        "lr_scheduler_type": "constant",
        "dataloader_num_workers": 0,
        "ddp_find_unused_parameters": False,
    }
    base.update(kw)
    return TrainingArguments(**base)


def _trainer_forward(module) -> bool:
    """A forward of the Trainer's own step: training mode, grad on, and not one of hf_stable's re-runs (the
    non-finite locator, the rollback probe), which run with the model's StepTap paused."""
    from hf_stable.core.step_tap import StepTap

    return module.training and torch.is_grad_enabled() and not StepTap.shared(module)._paused


class LossFault:
    """Forward hook that multiplies the training loss by `factor` (NaN, 1e3 ...) at chosen 1-based optimizer
    steps, on one rank or all: a fault in that step's data, which a re-run of the batch does not reproduce. Works
    with gradient accumulation 1 (one training forward per step)."""

    def __init__(self, model, steps, factor=float("nan"), rank: int | None = None):
        self.steps, self.factor, self.rank = set(steps), factor, rank
        self.forwards = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if not _trainer_forward(module):
            return None
        self.forwards += 1
        my_rank = int(os.environ.get("RANK", "0"))
        if self.forwards in self.steps and (self.rank is None or self.rank == my_rank):
            output["loss"] = output["loss"] * self.factor
        return output


class WeightDamage(TrainerCallback):
    """Damages the weights after the update of chosen steps (every LoRA B x `factor`, NaN by default, in
    `on_step_end`): what an overflowing update does. Every later batch then has a non-finite (or, with a large
    finite factor, a huge) loss and gradient until a rollback restores weights from before the damage - unlike a
    data fault, the same batch is fine at the snapshot's weights."""

    def __init__(self, model, steps, factor: float = float("nan"), rank: int | None = None):
        self.model, self.steps, self.factor, self.rank = model, set(steps), factor, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps and self.rank in (None, args.process_index):
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if "lora_B" in name:
                        p.mul_(self.factor)


class GradFaultOnRank(StabilityCallback):
    """Writes NaN into one gradient *after* DDP's all-reduce, on one rank only (list it before the guards): the
    case where only the flag all-reduce keeps the ranks together."""

    def __init__(self, step: int, rank: int):
        super().__init__()
        self.step, self.rank = step, rank

    @property
    def state_key(self) -> str:
        return "GradFaultOnRank"

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step and args.process_index == self.rank:
            p = next(p for p in model.parameters() if p.requires_grad and p.grad is not None)
            p.grad.view(-1)[0] = float("nan")


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def all_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(w).all()) for w in weights.values())


class Recorder(TrainerCallback):
    """After every step: trainable weights, a deep copy of the optimizer state, the group LRs."""

    def __init__(self, model):
        self.model = model
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.opt_state: dict[int, dict] = {}
        self.lrs: dict[int, list[float]] = {}
        self.effective_lrs: dict[int, list[float]] = {}

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.weights[state.global_step] = trainable(self.model)
        self.opt_state[state.global_step] = copy.deepcopy(optimizer.state_dict()["state"])

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # plain callbacks run after hf_stable's, so LRControl has applied its factors by now
        self.effective_lrs[state.global_step + 1] = [g["lr"] for g in optimizer.param_groups]

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.weights[state.global_step] = trainable(self.model)
        self.opt_state[state.global_step] = copy.deepcopy(optimizer.state_dict()["state"])
        self.lrs[state.global_step] = [g["lr"] for g in optimizer.param_groups]


def states_equal(a: dict, b: dict) -> bool:
    """Bitwise equality of two optimizer `state_dict()["state"]` mappings."""
    if set(a) != set(b):
        return False
    for idx, entry in a.items():
        if set(entry) != set(b[idx]):
            return False
        for key, value in entry.items():
            other = b[idx][key]
            if isinstance(value, torch.Tensor):
                if not torch.equal(value, other):
                    return False
            elif value != other:
                return False
    return True


def weights_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def is_nan_or_inf(x: float) -> bool:
    return not math.isfinite(x)


class OverflowPhases:
    """In the chosen steps (counted by training forwards) the loss of every forward, re-runs included, is x inf
    whenever the weights have moved from the initial ones: trained weights whose activations pass the fp16 limit on
    a stretch of the run while the initial weights handle it. `rank`: only on that rank (None: every rank)."""

    def __init__(self, model, steps, rank: int | None = None):
        self.steps, self.forwards, self.rank = set(steps), 0, rank
        self.initial = [p.detach().clone() for p in model.parameters()]
        model.register_forward_pre_hook(self._count)
        model.register_forward_hook(self._overflow)

    def _count(self, module, args):
        from hf_stable.core.step_tap import StepTap

        if module.training and torch.is_grad_enabled() and not StepTap.shared(module)._paused:
            self.forwards += 1

    def _overflow(self, module, args, output):
        here = self.rank is None or int(os.environ.get("RANK", "0")) == self.rank
        if not here or self.forwards not in self.steps:
            return output
        if any(not torch.equal(p, q) for p, q in zip(module.parameters(), self.initial, strict=False)):
            output["loss"] = output["loss"] * float("inf")
        return output
