"""`model.start_from`: where a later stage starts. An earlier stage's output directory holds either a LoRA adapter
(`adapter_config.json`: trained further on the same base, with the base rows the run repaired) or a merged export
(`config.json` and weights: the new base of a fresh adapter)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hf_stable.errors import ConfigError, ModelError
from hf_stable.logging import get_logger

logger = get_logger(__name__)

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass
class StartPoint:
    """A resolved `model.start_from`: `kind` 'adapter' or 'merged', its `path`, and for an adapter the base it was
    trained on (`adapter_config.json`'s `base_model_name_or_path`) and the stage chain so far (run_summary.json)."""

    kind: str
    path: Path
    adapter_base: str | None = None
    chain: list[str] | None = None


def _chain(directory: Path) -> list[str]:
    """The stages that made `directory` ('sft' for a run before stages existed), from its run_summary.json."""
    for candidate in (directory / "run_summary.json", directory.parent / "run_summary.json"):
        if candidate.is_file():
            try:
                summary = json.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                break
            chain = summary.get("stage_chain") if isinstance(summary, dict) else None
            return list(chain) if isinstance(chain, list) and chain else ["sft"]
    return ["sft"]


def resolve_start_from(start_from: str) -> StartPoint:
    """What `model.start_from` names.

    Raises:
        ConfigError: the path is missing, or holds neither a LoRA adapter nor a merged checkpoint.
    """
    path = Path(start_from).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model.start_from: {start_from!r} is not a directory (the earlier stage's training.output_dir, or its "
            "merged export)"
        )
    adapter = path / "adapter_config.json"
    if adapter.is_file():
        try:
            base = json.loads(adapter.read_text(encoding="utf-8")).get("base_model_name_or_path")
        except ValueError as e:
            raise ConfigError(f"model.start_from: {adapter} is not valid JSON ({e})") from None
        return StartPoint("adapter", path, adapter_base=base, chain=_chain(path))
    if (path / "config.json").is_file() and any((path / w).is_file() for w in _WEIGHTS):
        return StartPoint("merged", path, chain=_chain(path))
    raise ConfigError(
        f"model.start_from: {start_from!r} holds neither a LoRA adapter (adapter_config.json: the SFT run's output "
        "dir) nor a merged checkpoint (config.json + weights: `hf-stable export`); did the earlier run finish?"
    )


def _same_base(a: str | None, b: str) -> bool:
    if a is None:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def load_stage_model(cfg, args, start: StartPoint | None):
    """(model, tokenizer, base) for a stage: the base (`model.name_or_path`, or the merged export `start` names),
    with the earlier run's adapter made trainable again, or a fresh LoRA adapter (`lora:`) when there is none.

    Raises:
        ModelError: the adapter was trained on another base than `model.name_or_path`.
    """
    from hf_stable.modeling import apply_lora, load_model, load_tokenizer, resolve_base

    base = str(start.path) if start is not None and start.kind == "merged" else resolve_base(cfg.model)
    tokenizer_from = str(start.path) if start is not None else base
    tokenizer = load_tokenizer(
        cfg.model, tokenizer_from if (Path(tokenizer_from) / "tokenizer_config.json").is_file() else base
    )
    model = load_model(cfg, base)
    if start is None or start.kind == "merged":
        return (
            apply_lora(model, cfg.lora, args.gradient_checkpointing, quantization=cfg.model.quantization),
            tokenizer,
            base,
        )
    if not _same_base(start.adapter_base, base):
        raise ModelError(
            f"model.start_from: the adapter in {start.path} was trained on {start.adapter_base!r}, but "
            f"model.name_or_path is {base!r}; set model.name_or_path to the SFT run's base"
        )
    from peft import PeftModel

    from hf_stable.embeddings import apply_repair

    repaired = apply_repair(model, start.path)  # base rows the SFT run repaired are not in its adapter
    if repaired:
        logger.info("start_from: applied the earlier run's repaired base rows of %s", ", ".join(repaired["tokens"]))
    if cfg.model.quantization.enabled:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    if args.gradient_checkpointing:
        model.enable_input_require_grads()
    model = PeftModel.from_pretrained(model, str(start.path), is_trainable=True)
    logger.info("start_from: continuing the LoRA adapter of %s", start.path)
    return model, tokenizer, base
