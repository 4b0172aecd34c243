"""`generation_config.json` in the output dir: where generation stops, as training taught it.

A chat-template run teaches answers to end with the template's end-of-turn token (``<|eot_id|>``, ``<|im_end|>``),
which is often not ``tokenizer.eos_token`` (a Qwen2.5 base tokenizer's EOS is ``<|endoftext|>``). ``generate()``,
vLLM and TGI read ``eos_token_id`` from this file, so it lists the training samples' end tokens first, then the
tokenizer's EOS, then any stop ids the base model's own generation config already had. The base's other settings
(sampling defaults, BOS) are kept.
"""

from __future__ import annotations

from pathlib import Path

GENERATION_CONFIG_FILE = "generation_config.json"


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def generation_config(model, tokenizer, stop_token_ids):
    """A `transformers.GenerationConfig`: the model's own, with `stop_token_ids` first in ``eos_token_id``."""
    import copy

    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    config = copy.deepcopy(base) if isinstance(base, GenerationConfig) else GenerationConfig()
    stops = list(dict.fromkeys([*_as_list(stop_token_ids), *_as_list(tokenizer.eos_token_id)]))
    config.eos_token_id = list(dict.fromkeys([*stops, *_as_list(config.eos_token_id)]))
    if tokenizer.pad_token_id is not None:
        config.pad_token_id = int(tokenizer.pad_token_id)
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.bos_token_id = int(tokenizer.bos_token_id)
    # a config marked as derived from the model config is rebuilt from it by generate(): the stop ids would be lost
    config._from_model_config = False
    return config


def save_generation_config(output_dir, model, tokenizer, stop_token_ids) -> Path:
    """Write `generation_config` into `output_dir` (call on the main process) and return the file's path.

    Example:
        >>> save_generation_config("out", model, tokenizer, data.stop_token_ids)  # data = build_data(...)
        PosixPath('out/generation_config.json')
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    generation_config(model, tokenizer, stop_token_ids).save_pretrained(out)
    return out / GENERATION_CONFIG_FILE
