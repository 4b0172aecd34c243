"""Load the base model and tokenizer (embedded tiny base, local dir or Hub id) and wrap it with LoRA."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from hf_stable.config import RunConfig
from hf_stable.config.attention import ATTN_IMPLEMENTATION
from hf_stable.config.model import LoraSection, ModelConfig
from hf_stable.errors import ModelError
from hf_stable.logging import get_logger

logger = get_logger(__name__)

_LOCAL_PREFIXES = ("/", "./", "../", "~")


def resolve_base(cfg: ModelConfig) -> str:
    """Directory or Hub id to load. Builds the embedded base when asked; a local path must exist; a Hub id is
    checked once against the Hub (`hf_stable.hub.resolve_hub_model`: the cached snapshot when it cannot be reached).

    Raises:
        ModelError: a path that looks local (or names an existing parent dir) does not exist; the Hub cannot be
            reached and the model is not cached (one line naming model.name_or_path and the ways out).
    """
    if cfg.is_embedded:
        from hf_stable.embedded.builder import ensure_base

        return str(ensure_base(cfg.embedded_arch, cfg.embedded))
    name = cfg.name_or_path
    path = Path(name).expanduser()
    if name.startswith(_LOCAL_PREFIXES) or path.exists() or name.count("/") > 1:
        if not path.is_dir():
            raise ModelError(
                f"model.name_or_path: {name!r} does not exist (a local model directory was expected; "
                "use a Hub id like 'Qwen/Qwen2.5-0.5B' or 'embedded:tiny-llama')"
            )
        if not (path / "config.json").is_file():
            raise ModelError(f"model.name_or_path: {path} has no config.json, so it is not a model directory")
        return name
    from hf_stable.hub import resolve_hub_model

    # one quick look at the Hub (no retries) instead of a minute of retries per file when it cannot be reached
    return resolve_hub_model(name, cfg.revision)


def tokenizer_path(cfg: ModelConfig, base: str) -> str:
    if cfg.tokenizer:
        return cfg.tokenizer
    # Embedded bases keep the tokenizer in its own dir: AutoTokenizer on a Qwen2 model dir would pick
    # Qwen2Tokenizer and change the digit tokenisation.
    sub = Path(base) / "tokenizer"
    return str(sub) if sub.is_dir() else base


def load_tokenizer(cfg: ModelConfig, base: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = tokenizer_path(cfg, base)
    try:
        if cfg.is_embedded:
            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    except OSError as e:
        key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"  # the key the user set (or can set)
        raise ModelError(f"{key}: cannot load a tokenizer from {path!r}: {_first_line(e)}") from None
    if tok.pad_token is None:
        # Llama-3 ships no pad token; our collator supervises EOS by position, so pad == eos is safe.
        tok.pad_token = tok.eos_token
        logger.info("tokenizer has no pad token: using eos %r as pad (EOS stays supervised)", tok.eos_token)
    tok.padding_side = "right"
    return tok


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _torch_dtype(name: str):
    import torch

    return {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _quantized_load(cfg: RunConfig) -> dict:
    """`from_pretrained` keywords of a quantized base: the BitsAndBytesConfig and the one device it loads onto
    (bitsandbytes quantizes while loading, so the weights must land where they will train: this rank's GPU)."""
    q = cfg.model.quantization
    if not q.enabled:
        return {}
    import torch

    from hf_stable.import_utils import require

    require("bitsandbytes", f"model.quantization.load_in: {q.load_in}")
    use_cpu = bool(cfg.training.get("use_cpu")) or not torch.cuda.is_available()
    device = "cpu" if use_cpu else int(os.environ.get("LOCAL_RANK", "0") or 0)
    if use_cpu and q.load_in == "4bit":
        _say_missing_cpu_kernel()
    return {"quantization_config": q.bnb_config(), "device_map": {"": device}}


@functools.cache
def _say_missing_cpu_kernel() -> None:
    """4-bit on CPU is where bitsandbytes' fused kernel would run: say what `hf_stable.logging` kept quiet (once a
    process: the export loads the 4-bit base again to merge into it)."""
    import bitsandbytes  # noqa: F401  (its import is what tries the kernel)

    from hf_stable.logging import optional_kernels_notice

    if optional_kernels_notice().dropped:
        logger.info(
            "bitsandbytes' fused CPU 4-bit kernel is not installed (`pip install kernels`, >= 0.11.1): 4-bit layers "
            "use bitsandbytes' slower fallback"
        )


def is_quantized(model) -> bool:
    """The model (or the base under a PEFT wrapper) was loaded in 4-bit or 8-bit by bitsandbytes."""
    base = getattr(model, "get_base_model", lambda: model)()
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def load_model(cfg: RunConfig, base: str):
    """The base causal LM with the configured dtype, attention implementation and quantization."""
    from transformers import AutoModelForCausalLM

    attn = cfg.attention.implementation
    if attn == ATTN_IMPLEMENTATION:
        from hf_stable.attention import register

        register(cfg.attention)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            base,
            dtype=_torch_dtype(cfg.model.dtype),
            attn_implementation=attn,
            trust_remote_code=cfg.model.trust_remote_code,
            revision=cfg.model.revision,
            **_quantized_load(cfg),
        )
    except OSError as e:
        raise ModelError(f"model.name_or_path: cannot load {base!r}: {e}") from None
    except ValueError as e:
        if "attn_implementation" in str(e) or "attention" in str(e).lower():
            raise ModelError(f"attention.implementation: {attn!r} rejected by transformers: {e}") from None
        raise
    if cfg.model.quantization.enabled:
        from hf_stable.compat import keep_cpu_4bit_layout

        keep_cpu_4bit_layout(model)  # the frozen weights stay as loaded, in eval as in training
    return model


def apply_lora(
    model, lora: LoraSection, gradient_checkpointing: bool = False, quantization=None, trainable_tokens=None
):
    """Wrap `model` with a peft LoRA adapter (or return it unchanged for a full fine-tune).

    `trainable_tokens`: peft's `trainable_token_indices` ({embedding module name: token ids}), the rows
    `model.untrained_tokens: train` trains (`hf_stable.embeddings.trainable_token_indices`).

    A quantized base first goes through peft's `prepare_model_for_kbit_training`: every base weight frozen, the
    weights left in 16-bit (embeddings, lm_head, norms) cast to fp32 (unless `quantization.upcast_fp32` is off:
    then they keep their dtype), and gradient checkpointing (non-reentrant) when asked.

    Raises:
        ModelError: `lora.target_modules` matches no module of the model; a full fine-tune of a quantized base.
    """
    if is_quantized(model):
        if not lora.enabled:
            raise ModelError("lora.enabled: false on a quantized base; quantized weights cannot be trained")
        from peft import prepare_model_for_kbit_training

        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
        if quantization is not None and not quantization.upcast_fp32:
            for name, p in model.named_parameters():
                if p.dtype != dtypes[name]:
                    p.data = p.data.to(dtypes[name])
    if gradient_checkpointing:
        # With frozen base weights the checkpointed blocks would see inputs that do not require grad.
        model.enable_input_require_grads()
    if not lora.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    names = [name for name, _ in model.named_modules() if name]

    def matches(target: str) -> bool:  # peft's rule: the full module name, or a dotted suffix of it
        return any(n == target or n.endswith("." + target) for n in names)

    missing = [t for t in lora.target_modules if not matches(t)]
    if len(missing) == len(lora.target_modules):
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names if not n.rsplit(".", 1)[-1].isdigit()})
        raise ModelError(
            f"lora.target_modules: {lora.target_modules} match no module of the model "
            f"(module names include: {', '.join(leaves[:16])})"
        )
    if missing:
        logger.warning("lora.target_modules: %s match nothing in this model; ignoring them", missing)
    peft_cfg = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[t for t in lora.target_modules if t not in missing],
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        task_type="CAUSAL_LM",
        trainable_token_indices=trainable_tokens or None,
    )
    return get_peft_model(model, peft_cfg)


def count_parameters(model) -> tuple[int, int]:
    # ZeRO-3 partitions parameters (numel() 0 locally); ds_numel is the full size
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return trainable, total
