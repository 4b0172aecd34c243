"""Parameter roles: which part of a decoder LM a parameter belongs to, from its name alone.

Both the optimizer factory (LR / weight decay per group) and the gradient monitors (per-module grad norms) need
the same answer, so it lives here once.

Names handled (plain and PEFT-wrapped Llama / Qwen2 / Qwen3; the PEFT prefix `base_model.model.` is ignored):

    model.embed_tokens.weight                                    role embeddings      group "embeddings"
    model.layers.3.self_attn.q_proj.weight                       role layer   (3)     group "layer_3"
    model.layers.3.self_attn.q_proj.bias                         role bias    (3)     group "layer_3"
    model.layers.3.input_layernorm.weight / self_attn.q_norm     role norm    (3)     group "layer_3"
    model.norm.weight                                            role norm            group "norm"
    lm_head.weight  (also PEFT modules_to_save copies)           role lm_head         group "lm_head"
    ...layers.3.self_attn.q_proj.lora_A.default.weight           role lora_A  (3)     group "layer_3.lora_A"
    ...layers.3.self_attn.q_proj.lora_B.default.weight           role lora_B  (3)     group "layer_3.lora_B"
    ...embed_tokens.lora_embedding_A.default  (and _B)         role lora_embedding group "embeddings.lora_A" (.lora_B)
    ...q_proj.lora_magnitude_vector.default.weight  (DoRA)       role dora_magnitude  group "layer_3.dora_magnitude"
    anything else                                                role other           group "other"

Group-naming scheme: `<site>[.<adapter part>]`, where site is `embeddings`, `layer_<i>` (decoder depth i),
`norm` (the final norm), `lm_head` or `other`, and the adapter part is `lora_A`, `lora_B` or `dora_magnitude`.
Groups are what a gradient monitor reports (embeddings, each decoder layer, final norm, lm_head, LoRA A/B per
layer); a coarser view is `group.split(".")[-1]` for adapter parts or `Role.site` for location. Inside a decoder
layer, norms and biases share the layer's group (they are part of that layer); the optimizer factory splits them
further by `Role.role` because they take no weight decay.

Tied weights (Qwen2/Qwen3 tiny models tie `lm_head.weight` to `embed_tokens.weight`) are one tensor: it is
classified under the first name `named_parameters()` yields (the embedding) and counted once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

ROLES = (
    "embeddings",
    "layer",
    "norm",
    "bias",
    "lm_head",
    "lora_A",
    "lora_B",
    "lora_embedding",
    "dora_magnitude",
    "other",
)
SITES = ("embeddings", "layer", "norm", "lm_head", "other")

# The decoder stack: `model.layers.<i>.` (Llama/Qwen), also `h.<i>.` / `blocks.<i>.` for GPT-style names.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)(?:embed_tokens|wte|wpe|word_embeddings|embed_positions|tok_embeddings)(?:\.|$)")
_LM_HEAD_RE = re.compile(r"(?:^|\.)(?:lm_head|embed_out)(?:\.|$)")
_NORM_RE = re.compile(r"(?:^|_)(?:norm|layernorm|ln(?:_\w+)?|ln\d*)$")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Role:
    """What a parameter is (`role`), where it sits (`site`, `layer`) and which report group it belongs to.

    Args:
        role: one of `ROLES`.
        site: where the parameter lives: "embeddings", "layer", "norm" (final norm), "lm_head" or "other".
        layer: decoder depth parsed from the module path, or None outside the decoder stack.
        group: the report group name (`<site>[.<adapter part>]`, see the module docstring).
        lora_side: "A" or "B" for LoRA factors (including LoRA embeddings), else None.
    """

    role: str
    site: str
    layer: int | None
    group: str
    lora_side: str | None = None


def _site_of(parts: list[str], name: str) -> tuple[str, int | None]:
    match = _LAYER_RE.search(name)
    if match:
        return "layer", int(match.group(1))
    if _EMBED_RE.search(name):
        return "embeddings", None
    if _LM_HEAD_RE.search(name):
        return "lm_head", None
    module = _module_name(parts)
    if module and _NORM_RE.search(module):
        return "norm", None
    return "other", None


def _module_name(parts: list[str]) -> str:
    """The owning module's own name, skipping PEFT wrappers (`base_layer`, `default`, `modules_to_save`)."""
    skip = {"weight", "bias", "base_layer", "default", "modules_to_save", "original_module"}
    for part in reversed(parts[:-1]):
        if part not in skip:
            return part
    return ""


def _site_group(site: str, layer: int | None) -> str:
    return f"layer_{layer}" if site == "layer" else site


def classify(name: str) -> Role:
    """Return the `Role` of the parameter called `name` (as `model.named_parameters()` spells it).

    Example:
        >>> classify("base_model.model.model.layers.3.self_attn.q_proj.lora_B.default.weight")
        Role(role='lora_B', site='layer', layer=3, group='layer_3.lora_B', lora_side='B')
    """
    name = name.removeprefix(_PEFT_PREFIX)
    parts = name.split(".")
    site, layer = _site_of(parts, name)
    base = _site_group(site, layer)

    for side in ("A", "B"):
        if f"lora_embedding_{side}" in parts:
            return Role("lora_embedding", site, layer, f"{base}.lora_{side}", side)
        if f"lora_{side}" in parts:
            return Role(f"lora_{side}", site, layer, f"{base}.lora_{side}", side)
    if "lora_magnitude_vector" in parts:
        return Role("dora_magnitude", site, layer, f"{base}.dora_magnitude")

    if site == "embeddings":
        return Role("embeddings", site, layer, base)
    if site == "lm_head":
        return Role("lm_head", site, layer, base)
    if parts[-1] == "bias":
        return Role("bias", site, layer, base)
    module = _module_name(parts)
    if site == "norm" or (module and _NORM_RE.search(module)):
        return Role("norm", site, layer, base)
    if site == "layer":
        return Role("layer", site, layer, base)
    return Role("other", site, layer, base)


def named_parameters_once(model: torch.nn.Module, *, trainable_only: bool = True):
    """Yield `(name, param)` with every tensor once (tied weights under their first name)."""
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen or (trainable_only and not param.requires_grad):
            continue
        seen.add(id(param))
        yield name, param


def group_parameters(
    model: torch.nn.Module, *, trainable_only: bool = True
) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Map report-group name → `[(name, param), ...]`, every (trainable) parameter exactly once.

    Groups come out in model order (embeddings, layer_0, layer_0.lora_A, ..., norm, lm_head).

    Example:
        >>> groups = group_parameters(peft_model)
        >>> sorted(groups)[:2]
        ['layer_0.lora_A', 'layer_0.lora_B']
    """
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in named_parameters_once(model, trainable_only=trainable_only):
        groups.setdefault(classify(name).group, []).append((name, param))
    return groups


def num_decoder_layers(model: torch.nn.Module) -> int:
    """Number of decoder layers: the config's `num_hidden_layers`, else 1 + the deepest layer index in the names."""
    config = getattr(model, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = getattr(text, "num_hidden_layers", None)
        if isinstance(n, int) and n > 0:
            return n
    depths = [classify(name).layer for name, _ in model.named_parameters()]
    depths = [d for d in depths if d is not None]
    return max(depths) + 1 if depths else 0
