"""The rescue benchmark's task, tiny bases and stress cases (what goes wrong, and how it is injected).

Task: a 4-successor Markov language (p = .6/.2/.1/.1) over 128 tokens. A base is pretrained on language A, then
LoRA-fine-tuned on language B (half of A's transition rows re-drawn); the eval loss is on held-out B sequences.
"Another task" (mislabeled records, the long sample) is language C: a separately drawn table.

Faults are forward hooks on the training model, active only in the Trainer's own forwards (training mode, grad
on, hf_stable's re-runs excluded): `nan` / `spike` multiply the step loss by NaN / 1e3 (a transient fault a
re-run does not reproduce); `poison` / `burst` / `long` replace or extend the batch (bad data, which a re-run of
the same batch does reproduce). In a DDP case the fault hits rank 1 only.

`fp16` emulation (CPU has no fp16 autocast): in training forwards every `nn.Linear` output is rounded to fp16 and
becomes +-inf beyond the fp16 range (65504); the backward is the identity (as under a working loss scaler);
evaluation stays fp32. The tiny base's activations are small, so the range is scaled (`fp16_scale`): the limit sits
where 4 % of the base's training batches overflow somewhere, as for a base pretrained in bf16 whose activations
reach past 65504 on some inputs, fine-tuned in fp16. Such a batch overflows again when re-run (it is the data).
`bf16` is the Trainer's own CPU bf16 autocast (`bf16=True`).
"""

from __future__ import annotations

import contextlib
import io
import random
import tempfile
from dataclasses import dataclass

import torch
from transformers import TrainingArguments

VOCAB, LENGTH, BATCH = 128, 32, 8
LONG = 256  # tokens of the extreme-length sample (the batch's other rows are padded to it)
BURST = 10  # consecutive garbage batches in `poison_burst`
CLEAN_LR = 1e-2  # the best of 3e-3 / 1e-2 / 3e-2 on the clean task: "10x too high" is measured from a tuned LR
FP16_MAX = 65504.0
FP16_OVERFLOW = 0.04  # share of the base's training batches whose activations exceed the emulated fp16 range
TABLE_A, TABLE_C = 1234, 4321  # Markov table seeds: the pretraining language (B is A remapped) and another task


@dataclass(frozen=True)
class BaseSpec:
    layers: int
    hidden: int
    heads: int = 4
    kv_heads: int = 2


BASES = {"small": BaseSpec(4, 64), "deep": BaseSpec(8, 64), "wide": BaseSpec(4, 128)}


@dataclass(frozen=True)
class Case:
    """One stress case: the base it fine-tunes, the LR / warmup / precision, and the fault it injects."""

    name: str
    doc: str
    base: str = "small"
    lr_mult: float = 1.0
    warmup: int = 5
    fault: str | None = None  # nan | spike | poison | burst | long
    n_faults: int = 0
    mislabeled: float = 0.0  # fraction of training records taken from another task
    precision: str = "fp32"  # fp32 | bf16 | fp16 (emulated)
    ddp: bool = False
    logits: bool = False  # measure the max pre-softmax attention logit for every arm

    @property
    def clean(self) -> str:
        """The name of the clean case whose plain run is this case's reference."""
        return ("ddp_" if self.ddp else "") + "clean" + ("" if self.base == "small" else f"_{self.base}")


CASES = {
    c.name: c
    for c in [
        Case("clean", "no fault, tuned LR (the reference; no arm may be worse than plain here)"),
        Case("clean_deep", "no fault on the 8-layer base (reference of attn_logits)", base="deep"),
        Case("clean_wide", "no fault on the hidden-128 base (reference of its cases)", base="wide"),
        Case("lr_10x", "LR 10x the tuned one, sustained", lr_mult=10),
        Case("lr_30x", "LR 30x the tuned one, sustained, hidden-128 base", base="wide", lr_mult=30),
        Case("no_warmup", "the tuned LR without warmup, hidden-128 base", base="wide", warmup=0),
        Case(
            "attn_logits",
            "8-layer base at 3x LR: attention logits climb (no loss spike)",
            base="deep",
            lr_mult=3,
            logits=True,
        ),
        Case("fp16", "emulated fp16: 4% of the batches overflow in some layer (inf loss)", precision="fp16"),
        Case("bf16", "CPU bf16 autocast at the tuned LR", precision="bf16"),
        Case("nan", "loss NaN at 3 random steps", fault="nan", n_faults=3),
        Case("spikes", "loss x1e3 at 3 random steps", fault="spike", n_faults=3),
        Case("poison", "2 batches of uniform garbage tokens", fault="poison", n_faults=2),
        Case(
            "poison_burst", f"{BURST} consecutive garbage batches (a corrupted shard)", fault="burst", n_faults=BURST
        ),
        Case("mislabeled", "30% of the records are another task's sequences", mislabeled=0.3),
        Case("long_sample", f"2 steps with one extra {LONG}-token other-task sample", fault="long", n_faults=2),
        Case("ddp_clean", "2 gloo ranks, no fault (reference of the DDP cases)", ddp=True),
        Case("ddp_nan", "2 gloo ranks: loss NaN at 3 steps on rank 1 only", fault="nan", n_faults=3, ddp=True),
        Case("ddp_spike", "2 gloo ranks: loss x1e3 at 3 steps on rank 1 only", fault="spike", n_faults=3, ddp=True),
    ]
}


# --- data ------------------------------------------------------------------------------------------------------
def markov_ids(n: int, seed: int, remap: float = 0.0, table_seed: int = TABLE_A, length: int = LENGTH):
    """`n` sequences from a sparse Markov table; `remap` re-draws that fraction of its rows (language B)."""
    g = torch.Generator().manual_seed(table_seed)
    table = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    if remap:
        rows = torch.randperm(VOCAB, generator=g)[: int(remap * VOCAB)]
        table[rows] = torch.randint(0, VOCAB, (len(rows), 4), generator=g)
    probs = torch.tensor([0.6, 0.2, 0.1, 0.1])
    gs = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n,), generator=gs)
    picks = torch.multinomial(probs.expand(n * length, 4), 1, replacement=True, generator=gs).view(n, length)
    out = torch.empty(n, length, dtype=torch.long)
    out[:, 0] = starts
    for t in range(1, length):
        out[:, t] = table[out[:, t - 1], picks[:, t]]
    return out


def rows(ids) -> list[dict]:
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def train_rows(case: Case, seed: int, n: int) -> list[dict]:
    ids = markov_ids(n, seed=100 + seed, remap=0.5)
    if case.mislabeled:
        k = int(case.mislabeled * n)
        where = torch.randperm(n, generator=torch.Generator().manual_seed(200 + seed))[:k]
        ids[where] = markov_ids(k, seed=300 + seed, table_seed=TABLE_C)
    return rows(ids)


def eval_rows() -> list[dict]:
    return rows(markov_ids(128, seed=999, remap=0.5))


# --- training -------------------------------------------------------------------------------------------------
def training_args(out: str, **kw) -> TrainingArguments:
    """The Trainer settings every run shares: the bases' pretraining here and each arm's run (`rescue_harness`)."""
    base = {
        "output_dir": out,
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": 64,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 10**6,
        "dataloader_num_workers": 0,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 5,
        "ddp_find_unused_parameters": False,
    }
    base.update(kw)
    return TrainingArguments(**base)


# --- bases -----------------------------------------------------------------------------------------------------
def pretrain_base(name: str, steps: int = 250):
    """A base trained on language A (full fine-tune), the same for every arm and seed."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    spec = BASES[name]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=spec.hidden,
        intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=LONG,
    )
    base = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        args = training_args(
            tmp, per_device_train_batch_size=16, max_steps=steps, learning_rate=3e-3, seed=0, warmup_steps=10
        )
        Trainer(model=base, args=args, train_dataset=rows(markov_ids(steps * 16, seed=5))).train()
    base.eval()
    return base


@torch.no_grad()
def fp16_scale(base) -> float:
    """The factor at which FP16_OVERFLOW of the base's training batches overflow fp16 in some Linear output."""
    peak = [0.0]

    def hook(_m, _a, out):
        peak[0] = max(peak[0], float(out.detach().abs().max()))

    handles = [m.register_forward_hook(hook) for m in base.modules() if isinstance(m, torch.nn.Linear)]
    peaks = []
    try:
        for batch in markov_ids(100 * BATCH, seed=50, remap=0.5).split(BATCH):
            peak[0] = 0.0
            base(input_ids=batch)
            peaks.append(peak[0])
    finally:
        for h in handles:
            h.remove()
    limit = torch.tensor(peaks).quantile(1 - FP16_OVERFLOW).item()
    return FP16_MAX / limit


class _Fp16Range(torch.autograd.Function):
    """Forward: round to fp16 at an emulated scale (overflow -> inf). Backward: identity (a working loss scaler)."""

    @staticmethod
    def forward(ctx, y, scale):
        return (y * scale).to(torch.float16).to(y.dtype) / scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def emulate_fp16(model, scale: float) -> None:
    """Training forwards run in (emulated) fp16; evaluation stays fp32 (the question is whether training survived)."""

    def hook(module, _a, out):
        return _Fp16Range.apply(out, scale) if module.training else None

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(hook)


# --- faults ----------------------------------------------------------------------------------------------------
def fault_steps(case: Case, steps: int, seed: int) -> list[int]:
    """The case's fault steps: away from the first and last 10 (20 for a burst) when the run is long enough."""
    rng = random.Random(1000 + seed)
    if case.fault == "burst":
        start = rng.randrange(min(20, steps // 4), max(min(20, steps // 4) + 1, steps - BURST - 20))
        return list(range(start, start + BURST))
    if case.fault:
        lo = min(10, steps // 4)
        return sorted(rng.sample(range(lo, max(lo + case.n_faults, steps - lo)), case.n_faults))
    return []


class Faults:
    """Forward hooks that corrupt chosen training steps (1-based; one training forward per step) on `rank`."""

    def __init__(self, model, case: Case, steps: int, seed: int, rank: int = 0):
        self.kind = case.fault
        self.at = set(fault_steps(case, steps, seed)) if rank == (1 if case.ddp else 0) else set()
        self.forwards = 0
        self.gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        if self.at:
            model.register_forward_pre_hook(self._pre, with_kwargs=True)
            model.register_forward_hook(self._post)

    @staticmethod
    def _training(module) -> bool:
        """The Trainer's own forwards only: hf_stable's re-runs (locator, rollback probe) pause the StepTap."""
        from hf_stable.core.step_tap import StepTap

        return module.training and torch.is_grad_enabled() and not StepTap.shared(module)._paused

    def _pre(self, module, args, kwargs):
        if not self._training(module):
            return None
        self.forwards += 1
        if self.forwards not in self.at or self.kind not in ("poison", "burst", "long"):
            return None
        ids = kwargs["input_ids"]
        if self.kind == "long":
            extra = markov_ids(1, seed=400 + self.forwards, table_seed=TABLE_C, length=LONG).to(ids.device)
            padded = torch.zeros(ids.shape[0], LONG, dtype=ids.dtype, device=ids.device)
            padded[:, : ids.shape[1]] = ids
            labels = torch.full_like(padded, -100)
            labels[:, : ids.shape[1]] = kwargs["labels"]
            mask = torch.zeros_like(padded)
            mask[:, : ids.shape[1]] = 1
            kwargs["input_ids"] = torch.cat([padded, extra])
            kwargs["labels"] = torch.cat([labels, extra.clone()])
            kwargs["attention_mask"] = torch.cat([mask, torch.ones_like(extra)])
        else:
            garbage = torch.randint(0, VOCAB, ids.shape, generator=self.gen).to(ids.device)
            kwargs["input_ids"], kwargs["labels"] = garbage, garbage.clone()
        return args, kwargs

    def _post(self, module, args, output):
        if self._training(module) and self.forwards in self.at and self.kind in ("nan", "spike"):
            output["loss"] = output["loss"] * (float("nan") if self.kind == "nan" else 1e3)
            return output
        return None
