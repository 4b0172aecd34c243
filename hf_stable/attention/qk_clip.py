"""QK-clip: shrink a layer's query/key weights per head so its max attention logit comes back under τ.

For a head whose sampled max logit `S > τ`, with `γ = τ / S`, queries are scaled by `γ^α` and keys by
`γ^(1-α)` (α = 0.5 splits it evenly). Every logit of that head is a bilinear form in q and k (RoPE is a
rotation, so it commutes with scaling), hence scales by exactly `γ` and the maximum lands on τ.

What is scaled, by architecture and training mode:

* **Full fine-tuning, Llama / Qwen2**: the rows of `q_proj` / `k_proj` (weight *and* bias — Qwen2 has q/k
  biases) belonging to the head.
* **GQA**: a key head serves several query heads, so it is scaled by `γ_g^(1-α)` with `γ_g` the smallest
  γ of its group (the most violating query head), and each query head by its own `γ_h^α`. Every head then
  ends at or below τ; non-violating heads that share a key head with a violating one shrink a little.
* **Qwen3** (`q_norm` / `k_norm` RMSNorm after the projections): scaling `q_proj` does nothing, the norm
  divides it out. The norms' weights are what set the logit scale, but each is one `[head_dim]` vector
  shared by all heads, so the clip is per layer: `γ = τ / max over heads`, applied to `q_norm.weight`
  (`γ^α`) and `k_norm.weight` (`γ^(1-α)`). When those weights are frozen (LoRA), nothing can be clipped;
  the logit is then bounded by the frozen norms (`max|w_q| · max|w_k| · sqrt(head_dim)`), which we report.
* **LoRA** (base q/k frozen): the rows of `lora_B` of `q_proj` / `k_proj` (every active adapter) are
  scaled, i.e. only the adapter's *delta* shrinks. This is exact when the adapter dominates the logit,
  but the frozen base part is untouched: if the base alone exceeds τ, clipping cannot bring the logit
  under τ. The callback detects a clip that did not help and says so; `on_lora="error"` refuses instead.
  When only one of q/k carries an adapter, the whole factor goes to that side. DoRA is refused (its
  magnitude vector renormalises the rows we would scale).
* Sharded weights (DeepSpeed ZeRO-3, FSDP) are refused with a message: the rows are not on this rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class ClipResult:
    """What QK-clip did to one layer."""

    layer: int
    action: str  # "proj", "norm", "lora", or "refused"
    max_logit: float
    factor: float  # γ of the worst head (1.0 = nothing to do)
    heads: list[int] = field(default_factory=list)  # violating query heads
    reason: str | None = None


def attention_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """`{layer_idx: attention module}` for every module with `q_proj`, `k_proj` and a `layer_idx`."""
    found = {}
    for module in model.modules():
        if hasattr(module, "q_proj") and hasattr(module, "k_proj") and getattr(module, "layer_idx", None) is not None:
            found.setdefault(int(module.layer_idx), module)
    return found


def _is_lora(proj) -> bool:
    return hasattr(proj, "lora_B") and hasattr(proj, "base_layer")


def _base_linear(proj):
    return proj.base_layer if _is_lora(proj) else proj


def _lora_b(proj) -> list[torch.Tensor]:
    return [proj.lora_B[name].weight for name in proj.active_adapters if name in proj.lora_B]


def _sharded(weight: torch.Tensor, expected: int) -> bool:
    return type(weight).__name__ == "DTensor" or weight.numel() != expected or hasattr(weight, "ds_id")


def _quantized(weight: torch.Tensor) -> bool:
    return type(weight).__name__ in ("Params4bit", "Int8Params")  # bitsandbytes' packed weights


def layer_mode(attn: torch.nn.Module) -> tuple[str, str | None]:
    """`(mode, reason)`: which weights a clip would scale on this layer, or "refused" with why."""
    q_base, k_base = _base_linear(attn.q_proj), _base_linear(attn.k_proj)
    expected = q_base.out_features * q_base.in_features
    if _quantized(q_base.weight) or _quantized(k_base.weight):
        return "refused", "q_proj/k_proj weights are quantized (bitsandbytes): QK-clip needs full-precision weights"
    if _sharded(q_base.weight, expected):
        return "refused", "q_proj/k_proj weights are sharded (ZeRO-3 / FSDP): QK-clip needs whole weights per rank"
    edited = [
        q_base.weight,
        k_base.weight,
        *[w for p in (attn.q_proj, attn.k_proj) if _is_lora(p) for w in _lora_b(p)],
    ]
    if any(hasattr(w, "_hp_mapping") for w in edited):
        # ZeRO-1/2: the weights a forward reads are a copy of ZeRO's fp32 partitions, rewritten at every step
        return (
            "refused",
            "DeepSpeed ZeRO updates fp32 partitions of these weights: a clip of the weights is overwritten",
        )
    if hasattr(attn, "q_norm") and hasattr(attn, "k_norm"):
        if attn.q_norm.weight.requires_grad or attn.k_norm.weight.requires_grad:
            return "norm", None
        return "refused", "q_norm/k_norm are frozen: the logit scale is set by frozen norms, nothing to clip"
    if q_base.weight.requires_grad or k_base.weight.requires_grad:
        return "proj", None
    if _is_lora(attn.q_proj) or _is_lora(attn.k_proj):
        for proj in (attn.q_proj, attn.k_proj):
            if _is_lora(proj) and any(getattr(proj, "use_dora", {}).get(a, False) for a in proj.active_adapters):
                return "refused", "DoRA adapters renormalise their rows; QK-clip supports plain LoRA only"
        return "lora", None
    return "refused", "q_proj/k_proj are frozen and carry no LoRA adapter"


def frozen_norm_bound(attn: torch.nn.Module) -> float | None:
    """Upper bound of |logit| imposed by q_norm/k_norm weights (Qwen3), or None without such norms."""
    if not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
        return None
    dim = attn.q_norm.weight.numel()
    wq = float(attn.q_norm.weight.detach().abs().max())
    wk = float(attn.k_norm.weight.detach().abs().max())
    return wq * wk * math.sqrt(dim)  # scaling (1/sqrt(d)) * |q| (<= wq*sqrt(d)) * |k| (<= wk*sqrt(d))


def _scale_rows(tensor: torch.Tensor, factors: torch.Tensor, head_dim: int) -> None:
    """Multiply the `head_dim` rows of head i of a `[heads*head_dim, ...]` tensor by `factors[i]`, in place."""
    rows = factors.to(device=tensor.device, dtype=tensor.dtype).repeat_interleave(head_dim)
    tensor.mul_(rows.view(-1, *([1] * (tensor.dim() - 1))))


@torch.no_grad()
def clip_layer(attn: torch.nn.Module, head_max: list[float], tau: float, alpha: float = 0.5) -> ClipResult:
    """Rescale one attention layer so that each head's logit `S_h` becomes `min(S_h, τ)` (see module doc)."""
    layer = int(attn.layer_idx)
    heads = len(head_max)
    worst = max(head_max)
    gammas = [min(1.0, tau / s) if s > tau else 1.0 for s in head_max]
    violating = [h for h, g in enumerate(gammas) if g < 1.0]
    if not violating:
        return ClipResult(layer, "none", worst, 1.0)
    mode, reason = layer_mode(attn)
    result = ClipResult(layer, mode, worst, min(gammas), violating, reason)
    if mode == "refused":
        return result
    if mode == "norm":
        q_on, k_on = attn.q_norm.weight.requires_grad, attn.k_norm.weight.requires_grad
        a = alpha if (q_on and k_on) else (1.0 if q_on else 0.0)
        gamma = min(gammas)
        if q_on:
            attn.q_norm.weight.mul_(gamma**a)
        if k_on:
            attn.k_norm.weight.mul_(gamma ** (1.0 - a))
        return result

    q_base, k_base = _base_linear(attn.q_proj), _base_linear(attn.k_proj)
    head_dim = q_base.out_features // heads
    kv_heads = k_base.out_features // head_dim
    g_q = torch.tensor(gammas, dtype=torch.float64)
    g_k = g_q.view(kv_heads, heads // kv_heads).amin(dim=1)  # a key head follows its worst query head
    if mode == "proj":
        q_on, k_on = q_base.weight.requires_grad, k_base.weight.requires_grad
        q_targets = [q_base.weight] + ([q_base.bias] if q_base.bias is not None else [])
        k_targets = [k_base.weight] + ([k_base.bias] if k_base.bias is not None else [])
    else:  # LoRA: only the adapters' B matrices (the delta) are ours to scale
        q_on, k_on = _is_lora(attn.q_proj), _is_lora(attn.k_proj)
        q_targets = _lora_b(attn.q_proj) if q_on else []
        k_targets = _lora_b(attn.k_proj) if k_on else []
    a = alpha if (q_on and k_on) else (1.0 if q_on else 0.0)
    for tensor in q_targets if q_on else []:
        _scale_rows(tensor, g_q**a, head_dim)
    for tensor in k_targets if k_on else []:
        _scale_rows(tensor, g_k ** (1.0 - a), head_dim)
    return result


def qk_clip(
    model: torch.nn.Module, maxima: dict[int, list[float]], tau: float = 100.0, alpha: float = 0.5
) -> list[ClipResult]:
    """Clip every layer of `model` whose sampled max logit (`{layer: [per head]}`, from the probe) exceeds τ."""
    layers = attention_layers(model)
    results = []
    for idx, head_max in sorted(maxima.items()):
        if idx in layers and max(head_max) > tau:
            results.append(clip_layer(layers[idx], head_max, tau, alpha))
    return results
