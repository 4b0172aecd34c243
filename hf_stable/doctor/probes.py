"""Cheap probes the hazard checks rely on: a weight-free view of the model and a behavioural collator test.

Why probe instead of trusting types: whether EOS stays supervised or padding goes left is a property of what a
collator *does*; feeding it two known samples answers that for any collator, ours or a user's. Likewise the
LoRA-target check needs module names and types, which a model built on the meta device gives for free (no
weights are read or allocated, so it works for a 70B config on a laptop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_stable.data.samples import IGNORE_INDEX


@dataclass
class ModelFacts:
    """What the hazard checks need to know about a model, without running it.

    Args:
        model_type: ``config.model_type`` (e.g. "llama", "qwen2"), or "" when unknown.
        modules: module name → class name, for every named module.
        num_layers: decoder layers (0 when unknown).
        trainable_numel: parameters that will train (counted on a real model, estimated for a meta one).
        trainable_bytes: their bytes, in the dtype they will train in.
    """

    model_type: str = ""
    modules: dict[str, str] = field(default_factory=dict)
    num_layers: int = 0
    trainable_numel: int = 0
    trainable_bytes: int = 0


# Layer classes peft's LoRA can wrap (transformers' GPT-2 style Conv1D and bitsandbytes' quantized layers included).
LORA_WRAPPABLE = (
    "Linear",
    "Embedding",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "Conv1D",
    "NonDynamicallyQuantizableLinear",
    "Linear4bit",
    "Linear8bitLt",
)


def model_facts(model) -> ModelFacts:
    """Facts of an instantiated model (real, meta or PEFT-wrapped)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    modules = {name: type(m).__name__ for name, m in model.named_modules() if name}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelFacts(
        model_type=str(getattr(config, "model_type", "") or ""),
        modules=modules,
        num_layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        trainable_numel=sum(p.numel() for p in trainable),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
    )


def _lora_numel(model, lora) -> int:
    """Parameters of a LoRA adapter on `model`: r x (in + out) per targeted Linear (peft keeps them in fp32)."""
    matched = match_targets(lora.target_modules, {n: type(m).__name__ for n, m in model.named_modules() if n})
    modules = dict(model.named_modules())
    return sum(
        lora.r * (modules[n].in_features + modules[n].out_features)
        for names in matched.values()
        for n in names
        if hasattr(modules[n], "in_features")
    )


def meta_model(cfg, base: str):
    """`base` instantiated on the meta device from its config alone (no weights read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    remote = cfg.model.trust_remote_code
    config = AutoConfig.from_pretrained(base, trust_remote_code=remote, revision=cfg.model.revision)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=remote)


SHAPES_DIR = "shapes"  # hf_stable/doctor/shapes/<org>--<name>.json: the configs/ models' shapes


def shipped_shape(name: str):
    """The model config hf_stable ships for a Hub id its configs/ use (shapes copied from the model's config.json
    on the Hub), or None: the memory estimate and LoRA-target checks then work with the Hub out of reach."""
    import json
    from importlib import resources

    from transformers import AutoConfig

    entry = resources.files("hf_stable.doctor").joinpath(SHAPES_DIR, name.replace("/", "--") + ".json")
    if "/" not in name or not entry.is_file():
        return None
    values = json.loads(entry.read_text(encoding="utf-8"))
    return AutoConfig.for_model(values.pop("model_type"), **values)


def meta_model_from_config(config, trust_remote_code: bool = False):
    """`config`'s causal LM on the meta device (no weights read or allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def meta_model_facts(cfg, base: str, model=None) -> ModelFacts:
    """Facts of `base` from its config alone: the model is instantiated on the meta device (no weights)."""
    model = model if model is not None else meta_model(cfg, base)
    config = model.config
    facts = model_facts(model)
    if cfg.lora.enabled:
        facts.trainable_numel = _lora_numel(model, cfg.lora)
        facts.trainable_bytes = 4 * facts.trainable_numel
    else:
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else str(getattr(config, "dtype", None) or "float32")
        facts.trainable_bytes = facts.trainable_numel * (4 if "32" in dtype else 2)
    return facts


def match_targets(targets: list[str], modules: dict[str, str]) -> dict[str, list[str]]:
    """peft's suffix rule: target `t` selects module `n` when `n == t` or `n` ends with `.t`.

    Adapter modules a PEFT wrapper adds (`lora_A`, `lora_B`, `base_layer`, ...) are ignored so a wrapped
    model gives the same answer as its base.
    """
    out: dict[str, list[str]] = {}
    for t in targets:
        out[t] = [
            n for n in modules if (n == t or n.endswith("." + t)) and not any(p in n.split(".") for p in _PEFT_PARTS)
        ]
    return out


_PEFT_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout", "lora_magnitude_vector")


@dataclass
class CollatorProbe:
    """What a collator did with two known samples (a long one and a short one, both ending in EOS).

    Args:
        ok: the probe ran (False: the collator raised or returned something unreadable; see `error`).
        eos_supervised: the label at each sample's final EOS position is the EOS id (not -100).
        padding_side: "right", "left", "none" (packed, no padding) or "unknown".
        error: why the probe could not run.
    """

    ok: bool
    eos_supervised: bool | None = None
    padding_side: str = "unknown"
    error: str = ""


def _probe_samples(tokenizer) -> list[dict]:
    eos = tokenizer.eos_token_id
    words = tokenizer("the quick brown fox jumps", add_special_tokens=False)["input_ids"][:5]
    while len(words) < 5:
        words.append(words[-1] if words else 0)
    long_ids = [*words, eos]
    short_ids = [*words[:2], eos]
    return [
        {"input_ids": long_ids, "labels": [IGNORE_INDEX, IGNORE_INDEX, *long_ids[2:]]},
        {"input_ids": short_ids, "labels": [IGNORE_INDEX, *short_ids[1:]]},
    ]


def _rows(tensor) -> list[list[int]]:
    return tensor.tolist() if hasattr(tensor, "tolist") else [list(r) for r in tensor]


def probe_collator(collator, tokenizer) -> CollatorProbe:
    """Run `collator` on two samples and read back where it put them and whether EOS keeps its label."""
    samples = _probe_samples(tokenizer)
    eos = tokenizer.eos_token_id
    try:
        try:
            batch = collator([dict(s) for s in samples])
        except Exception:  # some collators build labels themselves and reject a labels key
            batch = collator([{"input_ids": s["input_ids"]} for s in samples])
        ids, labels = _rows(batch["input_ids"]), batch.get("labels")
    except Exception as e:
        return CollatorProbe(ok=False, error=f"{type(e).__name__}: {e}")
    if labels is None:
        return CollatorProbe(ok=True, eos_supervised=False, error="the collator returns no labels")
    labels = _rows(labels)
    lens = [len(s["input_ids"]) for s in samples]
    if len(ids) == 1 and len(ids[0]) == sum(lens):  # packed: samples back to back in one row
        ends = [lens[0] - 1, sum(lens) - 1]
        return CollatorProbe(ok=True, eos_supervised=all(labels[0][e] == eos for e in ends), padding_side="none")
    if len(ids) != 2:
        return CollatorProbe(ok=False, error=f"unexpected input_ids shape ({len(ids)} rows)")
    width, short = len(ids[1]), samples[1]["input_ids"]
    if ids[1][: len(short)] == short:
        side, starts = "right", [0, 0]
    elif ids[1][width - len(short) :] == short:
        side, starts = "left", [width - lens[0], width - lens[1]]
    else:
        return CollatorProbe(ok=False, error="could not locate the samples in the padded batch")
    # The last label of every row reads the EOS; a loss that shifts labels still trains "… -> EOS" from it.
    sup = all(labels[r][starts[r] + lens[r] - 1] == eos for r in range(2))
    return CollatorProbe(ok=True, eos_supervised=sup, padding_side=side)
