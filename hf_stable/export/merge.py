"""Merge a run's LoRA adapter into its base and save a standalone checkpoint (`hf-stable export`'s first half).

The base is the one the run trained on: the run's `resolved_config.yaml` names it (an embedded base is found, or
rebuilt from its seed, in the cache the config names), the adapter's `adapter_config.json` names where it was. The
merge is peft's `merge_and_unload` in float32 (W + BA computed once, exactly rounded), then one cast to the export
dtype: merging in 16 bits would round W and BA separately first. The base is loaded with transformers' default
attention, so the saved `config.json` names no hf_stable attention a plain transformers install could not load.

QLoRA: the adapter was trained against the dequantized 4-bit weights, not the 16-bit ones. By default
(`export.qlora_base: dequantized`) the base is loaded in 4 bits exactly as the run loaded it and every quantized
Linear's weight is replaced by its dequantized value (what the layer computed with) before the merge; `original`
merges into the 16-bit base. The mean and max |Δlogit| between the two merges on the reference prompts are reported
either way, and `config.json` keeps no `quantization_config`.

Untrained template-token rows the run repaired in the base (`model.untrained_tokens`) are not in the adapter: they
are written into the base from the run's `untrained_token_repair.safetensors` before the adapter is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_stable.errors import ExportError
from hf_stable.logging import get_logger

logger = get_logger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


def run_config(run_dir: Path):
    """The run's `RunConfig`, read from `resolved_config.yaml`."""
    import yaml

    from hf_stable.config import config_from_dict
    from hf_stable.outputs import CONFIG_FILE

    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ExportError(
            f"{run_dir}: no {CONFIG_FILE}, so it is not an hf_stable run directory (RUN_DIR is the run's "
            "training.output_dir)"
        )
    if not (run_dir / "adapter_config.json").is_file():
        raise ExportError(
            f"{run_dir}: no adapter_config.json: the run did not finish saving its LoRA adapter, or it was a full "
            "fine-tune (lora.enabled: false), whose output dir is already a standalone checkpoint"
        )
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return config_from_dict(data, source=str(path))


def resolve_dtype(requested: str, base: str, cfg) -> str:
    """`requested`, or for "auto" the dtype the base checkpoint is stored in (float32 when it names none)."""
    if requested != "auto":
        return requested
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        base, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
    )
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(stored).removeprefix("torch.") if stored is not None else "float32"
    return name if name in DTYPES else "float32"


def dequantized_weights(cfg, base: str) -> dict:
    """{Linear name: float32 weight} of the base loaded exactly as the run loaded it (4-bit, bitsandbytes), each
    dequantized: the weights the adapter was trained against."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM

    from hf_stable.modeling import _quantized_load, _torch_dtype

    quantized = AutoModelForCausalLM.from_pretrained(
        base,
        dtype=_torch_dtype(cfg.model.dtype),
        revision=cfg.model.revision,
        trust_remote_code=cfg.model.trust_remote_code,
        **_quantized_load(cfg),
    )
    out = {}
    for name, module in quantized.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            out[name] = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).float().cpu()
    return out


def load_merged(run_dir: Path, cfg, base: str, *, dequantized: dict | None = None):
    """The base with the run's adapter merged, in float32 (a plain transformers model: no peft wrapper left);
    `dequantized`: weights that replace the base's before the merge (`dequantized_weights`)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=torch.float32, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
    except OSError as e:
        raise ExportError(f"model.name_or_path: cannot load the base {base!r} to merge into: {e}") from None
    if dequantized is not None:
        with torch.no_grad():
            for name, weight in dequantized.items():
                model.get_submodule(name).weight.copy_(weight)
        logger.info(
            "export: merging into the %d dequantized 4-bit weights the adapter trained against", len(dequantized)
        )
    from hf_stable.embeddings import apply_repair

    # rows the run repaired in the base before training (untrained template tokens) are not in the adapter
    repaired = apply_repair(model, run_dir)
    if repaired:
        logger.info("export: applied the run's repaired base rows of %s before merging", ", ".join(repaired["tokens"]))
    model = PeftModel.from_pretrained(model, str(run_dir))
    return model.merge_and_unload().eval()


def save_merged(model, out: Path, dtype: str, run_dir: Path, tokenizer) -> None:
    """Cast to `dtype` and save weights (transformers' default sharding), config, generation config, tokenizer."""
    import torch
    from transformers import GenerationConfig

    model = model.to(getattr(torch, dtype))
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.config.dtype = dtype
    model.generation_config = GenerationConfig.from_pretrained(str(run_dir))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:  # never: a merged model is dense; make sure of it
        config.pop("quantization_config")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
