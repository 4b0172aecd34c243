"""What one training process holds, estimated before it runs: weights as stored (4-bit, 8-bit or 16/32-bit),
the trainable weights, their gradients, the optimizer state as the optimizer allocates it (8-bit blocks included),
activations and logits; the largest consumer is named.

It reads a model's modules and parameters, real or on the meta device (then the quantization the loader will
apply is predicted from `model.quantization`: bitsandbytes quantizes every Linear but the skipped ones and
`lm_head`, and `prepare_model_for_kbit_training` casts the 16-bit weights left to fp32). Storage of quantized
weights: NF4/FP4 half a byte per weight plus one scale per block of 64 (fp32, or 8-bit with double quantization
plus an fp32 scale per 256 blocks); LLM.int8 one byte plus an fp32 scale per row.

Activations follow the per-layer count of Korthikanti et al. (arXiv 2205.05198) for a frozen base with adapters on
every projection: each projection's input is kept for its LoRA factor, attention keeps q, k, v and its output
(memory-efficient SDPA: no s x s matrix), the MLP its gate/up/activation outputs. With gradient checkpointing
only each layer's input is kept, plus one layer's set while it is recomputed. Logits follow `training_loss`: the
model's forward (``chunked: false``, or a model the chunked loss does not fit) holds them for every token in the
compute dtype plus their fp32 copy, log-softmax and gradient (the loss upcasts); the chunked loss
(`hf_stable.loss`) holds one chunk of ``chunk_size x vocab`` at a time (the head's output, its fp32 copy and one
fp32 temporary: logsumexp's exponentials, or the gradient in the backward) plus, per token, the hidden row it
keeps for the backward and its NLL, log-sum-exp and indices. Frozen 4-bit weights are dequantized
one matmul at a time, so the largest such weight in the compute dtype is added once, twice in the backward; under
bf16/fp16 autocast the fp32 lm_head left by `prepare_model_for_kbit_training` is cast to 16 bits and that copy is
kept for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_stable.doctor.stage_checks import stage_memory_parts
from hf_stable.optim.bnb import STATE_TENSORS as BNB_STATE_TENSORS
from hf_stable.optim.bnb import state_bytes as bnb_state_bytes

GIB = 1024**3
_QUANTIZED_PARAMS = ("Params4bit", "Int8Params")
_FP32_STATE = {"adamw": 2, "lion": 1, "sgd": 1}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class MemoryEstimate:
    """Bytes by consumer; `total`, `largest()`; `notes` say what was predicted rather than counted."""

    parts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def largest(self) -> tuple[str, int]:
        return max(self.parts.items(), key=lambda kv: kv[1])

    def describe(self) -> str:
        rows = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1]))
        return f"{self.total / GIB:.2f} GiB = {rows} (GiB)"


def quantized_bytes(numel: int, out_features: int, load_in: str, double_quant: bool) -> int:
    """Storage of one bitsandbytes-quantized weight of `numel` values."""
    if load_in == "8bit":
        return numel + 4 * out_features
    blocks = -(-numel // 64)
    scales = blocks + 4 * -(-blocks // 256) + 4 * 256 if double_quant else 4 * blocks
    return -(-numel // 2) + scales


def _weight_bytes(p) -> int:
    total = p.numel() * p.element_size()
    qs = getattr(p, "quant_state", None)
    if qs is not None:  # a real Params4bit: its scales (and nested scales) too
        for t in (getattr(qs, "absmax", None), getattr(qs, "code", None)):
            total += t.numel() * t.element_size() if t is not None else 0
        nested = getattr(qs, "state2", None)
        if nested is not None:
            total += sum(t.numel() * t.element_size() for t in (nested.absmax, nested.code) if t is not None)
    scb = getattr(p, "SCB", None)
    return total + (scb.numel() * scb.element_size() if scb is not None else 0)


def _lora_numels(model, cfg) -> list[int]:
    """Sizes of the LoRA factors a meta model would get (A: r x in, B: out x r)."""
    from hf_stable.doctor.probes import match_targets

    modules = dict(model.named_modules())
    matched = match_targets(cfg.lora.target_modules, {n: type(m).__name__ for n, m in modules.items() if n})
    out = []
    for names in matched.values():
        for n in names:
            m = modules[n]
            if hasattr(m, "in_features"):
                out += [cfg.lora.r * m.in_features, m.out_features * cfg.lora.r]
    return out


def _weights(model, cfg, meta: bool) -> tuple[int, int, int, int, list[int]]:
    """(quantized bytes, other frozen bytes, trainable bytes, largest quantized weight's numel, trainable numels)."""
    q = cfg.model.quantization
    dtype = cfg.model.dtype if cfg.model.dtype in _DTYPE_BYTES else "float32"
    # prepare_model_for_kbit_training upcasts the 16-bit weights left to fp32 (model.quantization.upcast_fp32)
    frozen_bytes = 4 if q.enabled and q.upcast_fp32 else _DTYPE_BYTES[dtype]
    quant = other = largest = 0
    seen = set()
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if type(p).__name__ in _QUANTIZED_PARAMS:
                quant += _weight_bytes(p)
                largest = max(largest, int(module.in_features) * int(module.out_features))
            elif meta and pname == "weight" and type(module).__name__ == "Linear" and q.quantizes(name):
                quant += quantized_bytes(p.numel(), p.shape[0], q.load_in, q.double_quant)
                largest = max(largest, p.numel())
            elif meta or not p.requires_grad:
                other += p.numel() * (frozen_bytes if meta and p.is_floating_point() else p.element_size())
    if meta and cfg.lora.enabled:
        numels = _lora_numels(model, cfg)
        return quant, other, 4 * sum(numels), largest, numels
    if meta:  # full fine-tune: every weight trains (no quantization: refused by the config checks)
        return quant, 0, other, largest, [p.numel() for p in model.parameters()]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return quant, other, sum(p.numel() * p.element_size() for p in trainable), largest, [p.numel() for p in trainable]


def _optimizer_bytes(cfg, trainable_bytes: int, numels: list[int]) -> int:
    name = cfg.optim.name
    if name in BNB_STATE_TENSORS:
        return sum(bnb_state_bytes(n, BNB_STATE_TENSORS[name], cfg.optim.bnb_min_8bit_size) for n in numels)
    if name == "sgd" and cfg.optim.sgd_momentum == 0:
        return 0
    return _FP32_STATE.get(name, 2) * trainable_bytes


def estimate_memory(model, cfg, s, *, meta: bool = False) -> MemoryEstimate:
    """The estimate for `model` (a real model as it will train, or `meta=True` for one built on the meta device)
    at the run's micro-batch and `data.max_length`, precision and checkpointing."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    h, layers = int(config.hidden_size), int(config.num_hidden_layers)
    inter = int(getattr(config, "intermediate_size", 4 * h) or 4 * h)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    vocab = int(config.vocab_size)
    q = cfg.model.quantization

    quant, other, trainable, largest, numels = _weights(model, cfg, meta)
    act_bytes = 2 if (s.bf16 or s.fp16) else (_DTYPE_BYTES.get(q.compute_dtype, 4) if q.enabled else 4)
    # DPO: each micro-batch row is a chosen and a rejected sequence, run through the model together
    tokens = max(1, s.micro_batch) * int(cfg.data.max_length) * (2 if getattr(cfg, "stage", "sft") == "dpo" else 1)
    lora = cfg.lora.enabled
    per_layer = (
        tokens
        * act_bytes
        * (
            (4 * h if lora else 0)  # q/k/v/gate/up inputs (shared: 2 norms' outputs) + o/down inputs for the adapters
            + 2 * h  # the two norms' inputs (residual stream)
            + 2 * heads * head_dim
            + 2 * kv * head_dim  # q, attention output; k, v
            + 3 * inter  # gate, up, activation
            + (inter if lora else 0)  # down_proj's input for its adapter
        )
    )
    if s.gradient_checkpointing:
        activations = layers * tokens * h * act_bytes + per_layer
    else:
        activations = layers * per_layer
    parts = {
        "quantized weights" if q.enabled else "frozen weights": quant if q.enabled else other,
        "trainable weights": trainable,
        "gradients": trainable,
        "optimizer state": _optimizer_bytes(cfg, trainable, numels),
        "activations": activations,
        "logits": _logits_bytes(model, cfg, tokens, vocab, h, act_bytes),
    }
    extra = stage_memory_parts(
        cfg, s, h=h, layers=layers, kv_heads=kv, head_dim=head_dim, weight_bytes=trainable if lora else quant + other
    )
    parts.update(extra)
    if q.enabled:
        parts["unquantized weights (embeddings, lm_head, norms)"] = other
        parts["dequantized weight (transient)"] = 2 * largest * _DTYPE_BYTES.get(q.compute_dtype, 2)
        head = getattr(model, "get_output_embeddings", lambda: None)()
        fp32_head = head is not None and (
            head.weight.dtype == torch.float32 if not meta else q.upcast_fp32 or cfg.model.dtype == "float32"
        )
        if (s.bf16 or s.fp16) and fp32_head:  # autocast's 16-bit copy of the fp32 head, kept for the backward
            parts["lm_head autocast copy"] = vocab * h * 2
    est = MemoryEstimate({k: int(v) for k, v in parts.items() if v})
    if extra:
        est.notes.append(
            f"stage {cfg.stage}: {', '.join(extra)} counted"
            + (", chosen + rejected rows" if cfg.stage == "dpo" else "")
        )
    if meta:
        est.notes.append("weights predicted from the model config (meta device)")
    if _chunked_loss(model, cfg):
        size = cfg.training_loss.chunk_size
        est.notes.append(f"logits: chunked loss, {min(size, tokens)} of {tokens} tokens at a time (training_loss)")
    return est


def _chunked_loss(model, cfg) -> bool:
    """Whether training steps will take the chunked loss (`training_loss.chunked` and a model it fits)."""
    loss = getattr(cfg, "training_loss", None)
    if loss is None or not loss.chunked or getattr(cfg, "stage", "sft") != "sft":  # TRL's stages: their own loss
        return False
    from hf_stable.loss import causal_lm_of, unsupported_reason

    return unsupported_reason(causal_lm_of(model)) is None


def _logits_bytes(model, cfg, tokens: int, vocab: int, h: int, act_bytes: int) -> int:
    """The loss's peak: the whole logits (the model's forward) or one chunk's plus per-token rows (chunked)."""
    if not _chunked_loss(model, cfg):
        return tokens * vocab * (act_bytes + 12)
    rows = min(tokens, cfg.training_loss.chunk_size)
    return rows * vocab * (act_bytes + 8) + tokens * (h * act_bytes + 24)


def memory_budget(doctor) -> tuple[float | None, str]:
    """Bytes the run may use and where that number comes from: `doctor_checks.memory_budget_gib`, else the GPU's
    memory x `memory_headroom`, else the host's available memory."""
    import torch

    if doctor.memory_budget_gib is not None:
        return doctor.memory_budget_gib * GIB * doctor.memory_headroom, (
            f"doctor_checks.memory_budget_gib {doctor.memory_budget_gib:g} x memory_headroom {doctor.memory_headroom:g}"
        )
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return (
            total * doctor.memory_headroom,
            f"GPU 0 {total / GIB:.1f} GiB x memory_headroom {doctor.memory_headroom:g}",
        )
    from hf_stable.core.snapshot_size import available_host_memory

    return float(available_host_memory()), "available host memory"


def memory_findings(cfg, s, doctor, *, model=None, meta_model=None) -> list:
    """One finding: the estimate, its largest consumer, and whether it fits the budget (warning when not)."""
    from hf_stable.doctor.findings import Finding

    if model is None and meta_model is None:
        return []
    est = estimate_memory(model if model is not None else meta_model, cfg, s, meta=model is None)
    budget, source = memory_budget(doctor)
    name, size = est.largest()
    q = cfg.model.quantization
    how = f"base in {q.load_in} {q.quant_type if q.load_in == '4bit' else ''}".rstrip() if q.enabled else "base"
    evidence = (
        f"{est.describe()}; {how}, optim.name {cfg.optim.name}, micro-batch {max(1, s.micro_batch)} x "
        f"data.max_length {cfg.data.max_length}, gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}"
        + (f"; {'; '.join(est.notes)}" if est.notes else "")
    )
    what = f"estimated training memory {est.total / GIB:.2f} GiB; largest: {name} ({size / GIB:.2f} GiB)"
    if budget is not None and est.total > budget:
        fix = (
            "load the base in 4-bit (model.quantization.load_in: 4bit), use an 8-bit optimizer "
            "(optim.name: paged_adamw_8bit), turn on gradient checkpointing, or lower the micro-batch / max_length"
        )
        return [
            Finding(
                "warning",
                f"{what} exceeds {budget / GIB:.2f} GiB ({source})",
                evidence,
                fix,
                check="hazards.memory_estimate",
            )
        ]
    fits = f"; fits {budget / GIB:.2f} GiB ({source})" if budget is not None else ""
    return [Finding("info", what + fits, evidence, check="hazards.memory_estimate")]
