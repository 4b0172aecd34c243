"""Shared pieces of the post-training tests and benchmark: a tiny LoRA Llama with an offline tokenizer, preference /
prompt data, real TRL trainers (DPO, KTO, GRPO) built as a user would, and fault injectors that act inside the step.

Kept free of pytest so `torchrun` scripts and `benchmarks/posttrain.py` can import it too.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import random
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch
from transformers import TrainerCallback

_TOKENIZER = None


def tiny_tokenizer():
    """A byte-level BPE trained on digit sequences and a chat template (cached per process)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from hf_stable.embedded.tokenizer import train_tokenizer

        rng = random.Random(0)
        corpus = [" ".join(str(rng.randrange(10)) for _ in range(12)) for _ in range(300)]
        _TOKENIZER = train_tokenizer(corpus + ["count up", "count down", "answer"], vocab_size=160)
    return _TOKENIZER


def tiny_policy(seed: int = 0):
    """A from-config 2-layer Llama (hidden 32) with a rank-4 LoRA adapter on the tiny tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))


def _count(start: int, n: int, step: int) -> str:
    return " ".join(str((start + i * step) % 10) for i in range(n))


def preference_rows(n: int = 32, seed: int = 0) -> list[dict]:
    """Prompt 'count up a b c', chosen: the next digits up, rejected: the digits down (a learnable preference)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = rng.randrange(10)
        rows.append(
            {"prompt": f"count up {_count(s, 3, 1)}", "chosen": _count(s + 3, 3, 1), "rejected": _count(s, 3, -1)}
        )
    return rows


def kto_rows(n: int = 32, seed: int = 0) -> list[dict]:
    """Unpaired preference rows (KTO): the chosen completion labelled True, the rejected one False, alternating."""
    rows = []
    for i, r in enumerate(preference_rows(n, seed)):
        good = i % 2 == 0
        rows.append({"prompt": r["prompt"], "completion": r["chosen"] if good else r["rejected"], "label": good})
    return rows


def prompt_rows(n: int = 32, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"count up {_count(rng.randrange(10), 3, 1)}"} for _ in range(n)]


def digit_reward(completions, **kwargs) -> list[float]:
    """Dense reward: the fraction of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def sparse_reward(completions, **kwargs) -> list[float]:
    """0/1 reward that a random tiny policy almost never earns: most groups are all 0 (no learning signal)."""
    return [1.0 if "7" in text else 0.0 for text in completions]


def common_args(out, **kw) -> dict:
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
        "lr_scheduler_type": "constant",
        "dataloader_num_workers": 0,
    }
    base.update(kw)
    return base


def build_trainer(kind: str, out, callbacks=(), seed: int = 0, reward=None, data=None, **kw):
    """A real TRL trainer (``dpo``, ``kto``, ``grpo``, ``rloo``) on the tiny policy, TRL's defaults (max_grad_norm 1.0)."""
    from datasets import Dataset

    tok = tiny_tokenizer()
    model = tiny_policy(seed)
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common_args(out, **kw), max_length=32)
        ds = Dataset.from_list(data or preference_rows())
        return DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=list(callbacks))
    if kind == "kto":
        from trl import KTOConfig, KTOTrainer

        args = KTOConfig(**common_args(out, **kw), max_length=32)
        ds = Dataset.from_list(data or kto_rows())
        return KTOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=list(callbacks))
    if kind in ("grpo", "rloo"):
        import trl

        config_cls, trainer_cls = (
            (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
        )
        kw.setdefault("num_generations", 4)
        kw.setdefault("max_completion_length", 6)
        args = config_cls(**common_args(out, **kw))
        ds = Dataset.from_list(data or prompt_rows())
        return trainer_cls(
            model=model,
            reward_funcs=reward or digit_reward,
            args=args,
            train_dataset=ds,
            processing_class=tok,
            callbacks=list(callbacks),
        )
    raise ValueError(kind)


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def all_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(w).all()) for w in weights.values())


class StepFaults(TrainerCallback):
    """Faults inside chosen 1-based optimizer steps, before the gradient is read or clipped: ``nan_forward`` (the first
    decoder layer's output NaN in the step's training forwards), ``nan_grad`` (one LoRA gradient NaN) and
    ``scale_grad`` (every LoRA gradient x factor), on every rank or on `rank` only. Records the trainable weights after every step in `weights`."""

    def __init__(self, model, nan_forward=(), nan_grad=(), scale_grad=None, rank: int | None = None):
        self.model, self.rank = model, rank
        self.nan_forward, self.nan_grad, self.scale_grad = set(nan_forward), set(nan_grad), dict(scale_grad or {})
        self.step = 0
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        layer = next(m for n, m in model.named_modules() if n.endswith("layers.0"))
        layer.register_forward_hook(self._forward)
        self._params = [p for n, p in model.named_parameters() if p.requires_grad]
        for i, p in enumerate(self._params):
            p.register_hook(lambda g, i=i: self._grad(i, g))

    def _forward(self, module, args, output):
        if self.step in self.nan_forward and module.training and torch.is_grad_enabled():
            from hf_stable.core.step_tap import StepTap

            if not StepTap.shared(self.model)._paused:  # a re-run sees the batch as it is (the fault was transient)
                hidden = output[0] if isinstance(output, tuple) else output
                hidden = hidden * math.nan
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return None

    def _grad(self, i, grad):
        from hf_stable.core.step_tap import StepTap

        if StepTap.shared(self.model)._paused:
            return None
        if self.step in self.nan_grad and i == 0:
            return grad * math.nan
        if self.step in self.scale_grad:
            return grad * self.scale_grad[self.step]
        return None

    def on_train_begin(self, args, state, control, **kwargs):
        self.weights[state.global_step] = trainable(self.model)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1 if self.rank in (None, args.process_index) else 0

    def on_step_end(self, args, state, control, **kwargs):
        self.weights[state.global_step] = trainable(self.model)


class RolloutFaults:
    """Faults in a GRPO / RLOO step's own inputs, on chosen 1-based optimizer steps: ``nan_old`` (the old log-probs
    NaN, as a broken sampler would hand them over) and ``ratio`` (the old log-probs lowered by 10: every importance
    ratio x e^10 = 22026). Wraps the instance's ``_prepare_inputs`` (TRL's per-step slice of the generation batch).
    `weights` holds the trainable weights after every step."""

    def __init__(self, trainer, nan_old=(), ratio=()):
        self.trainer, self.nan_old, self.ratio = trainer, set(nan_old), set(ratio)
        prepare = trainer._prepare_inputs

        def _prepare_inputs(batch):
            inputs = prepare(batch)
            step = trainer.state.global_step + 1
            if trainer.model.training and step in self.nan_old | self.ratio:
                inputs = self._damage(dict(inputs), step in self.nan_old)
            return inputs

        trainer._prepare_inputs = _prepare_inputs

    def _damage(self, inputs: dict, nan: bool) -> dict:
        mask = inputs["completion_mask"]
        if "old_logps" in inputs:  # RLOO: one log-prob per sequence
            inputs["old_logps"] = inputs["old_logps"] * math.nan if nan else inputs["old_logps"] - 10.0
            return inputs
        if nan:
            inputs["old_per_token_logps"] = torch.full(mask.shape, math.nan, device=mask.device)
            return inputs
        old = inputs.get("old_per_token_logps")
        if old is None:  # on-policy step: TRL would use the current log-probs themselves
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            att = torch.cat([inputs["prompt_mask"], mask], dim=1)
            with torch.no_grad():
                old, _, _ = self.trainer._get_per_token_logps_and_entropies(self.trainer.model, ids, att, mask.size(1))
        inputs["old_per_token_logps"] = old.detach() - 10.0
        return inputs


def quiet(fn, *a, **kw):
    """`fn(*a, **kw)` with its prints and warnings swallowed (TRL and transformers are chatty on tiny models)."""
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        return fn(*a, **kw)
