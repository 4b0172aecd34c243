"""What the recipe does about untrained template-token rows (`model.untrained_tokens`), and how the result travels.

`repair` (the default) sets each flagged row to the mean of the trained rows of its matrix before LoRA wraps the
model: a token the base never learnt then starts where an average token sits, which the frozen layers can read, rather
than at zero (whose RMSNorm output is zero, or noise divided by eps). `train` repairs the same way and then trains
those rows through peft's `trainable_token_indices` (the adapter stores their full values). `ignore` only warns.

A repaired row is a change to the *base*, which a LoRA adapter does not hold: the run writes the repaired rows to
`untrained_token_repair.safetensors` next to the adapter, `hf-stable export` applies them before merging, the model
card says so, and `apply_repair` does it for anyone loading the adapter with peft themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_stable.embeddings.untrained import (
    UntrainedTokens,
    embedding_matrices,
    find_untrained_tokens,
    used_special_tokens,
)
from hf_stable.errors import ModelError
from hf_stable.logging import get_logger

logger = get_logger(__name__)

REPAIR_FILE = "untrained_token_repair.safetensors"
MODES = ("repair", "train", "ignore")
_META_KEY = "hf_stable_untrained_tokens"


def repair_rows(model, found: UntrainedTokens) -> dict:
    """Set every flagged row to its matrix's trained-row mean, in place. Returns {matrix: (ids, rows)} as written."""
    import torch

    written = {}
    matrices = embedding_matrices(model)
    with torch.no_grad():
        for matrix, weight in matrices.items():
            ids = found.ids_in(matrix)
            mean = found.stats.get(matrix, {}).get("mean")
            if not ids or mean is None:
                continue
            index = torch.tensor(ids, dtype=torch.long, device=weight.device)
            weight[index] = mean.to(device=weight.device, dtype=weight.dtype).expand(len(ids), -1)
            written[matrix] = (ids, weight[index].detach().cpu().clone())
    found.repaired = bool(written)
    return written


def handle_untrained_tokens(model, tokenizer, data, mode: str = "repair") -> UntrainedTokens:
    """The recipe's one call, before LoRA: find the untrained template-token rows, then repair them unless `ignore`.

    Logs one line naming the tokens and what was done. The rows as written are kept on the result
    (`result.written`) for `save_repair`.

    Raises:
        ModelError: an unknown mode.
    """
    if mode not in MODES:
        raise ModelError(f"model.untrained_tokens: got {mode!r}, allowed: {', '.join(MODES)}")
    found = find_untrained_tokens(embedding_matrices(model), tokenizer, used_special_tokens(tokenizer, data), mode)
    if not found.rows:
        logger.info("untrained tokens: none among the %d special tokens the data uses", len(found.candidates))
        return found
    if mode == "ignore":
        logger.warning(
            "untrained tokens (model.untrained_tokens: ignore, left as they are): %s. LoRA cannot change these rows; "
            "set model.untrained_tokens: repair (or train)",
            found.describe(),
        )
        return found
    found.written = repair_rows(model, found)
    logger.info(
        "untrained tokens %s: set to the trained rows' mean%s (model.untrained_tokens: %s) - %s",
        ", ".join(found.names()),
        ", then trained (peft trainable_token_indices)" if mode == "train" else "",
        mode,
        found.describe(),
    )
    return found


def trainable_token_indices(model, found: UntrainedTokens | None) -> dict[str, list[int]] | None:
    """peft's `trainable_token_indices` for `train`: {embedding module name: ids, lm_head name: ids when untied}."""
    if found is None or found.mode != "train" or not found.rows:
        return None
    out = {}
    modules = {"input_embedding": model.get_input_embeddings(), "lm_head": model.get_output_embeddings()}
    for matrix, module in modules.items():
        ids = found.ids_in(matrix)
        if ids and module is not None:
            out[next(n for n, m in model.named_modules() if m is module)] = ids
    return out or None


def save_repair(output_dir, found: UntrainedTokens | None) -> Path | None:
    """Write the repaired rows next to the adapter (`untrained_token_repair.safetensors`); None when none were."""
    import torch
    from safetensors.torch import save_file

    written = found.written if found is not None else None
    if not written:
        return None
    tensors = {}
    for matrix, (ids, rows) in written.items():
        tensors[f"{matrix}.ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors[f"{matrix}.rows"] = rows.contiguous()
    path = Path(output_dir) / REPAIR_FILE
    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(found.to_dict())})
    return path


def read_repair(directory) -> tuple[dict, dict] | None:
    """(metadata, {matrix: (ids, rows)}) of `directory/untrained_token_repair.safetensors`, or None without one."""
    from safetensors import safe_open

    path = Path(directory) / REPAIR_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(_META_KEY, "{}"))
        rows = {m: (f.get_tensor(f"{m}.ids").tolist(), f.get_tensor(f"{m}.rows")) for m in _matrices(f.keys())}
    return meta, rows


def _matrices(keys) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in keys})


def apply_repair(model, directory) -> dict | None:
    """Write the repaired rows saved in `directory` into `model`'s base rows (before `PeftModel.from_pretrained` or a
    merge). Returns the saved metadata (tokens, mode), or None when the run repaired nothing.

    Raises:
        ModelError: the saved rows do not fit the model (another base: other width or vocabulary).

    Example:
        >>> base = AutoModelForCausalLM.from_pretrained(base_path)
        >>> apply_repair(base, run_dir)
        >>> model = PeftModel.from_pretrained(base, run_dir)
    """
    import torch

    saved = read_repair(directory)
    if saved is None:
        return None
    meta, rows = saved
    matrices = embedding_matrices(model)
    with torch.no_grad():
        for matrix, (ids, values) in rows.items():
            weight = matrices.get(matrix, matrices["input_embedding"])  # untied when saved, tied now: one matrix
            if values.shape[-1] != weight.shape[-1] or max(ids) >= weight.shape[0]:
                raise ModelError(
                    f"{Path(directory) / REPAIR_FILE}: rows of width {values.shape[-1]} for ids up to {max(ids)} do "
                    f"not fit the base's {matrix} ({tuple(weight.shape)}): this is not the base the run trained on"
                )
            index = torch.tensor(ids, dtype=torch.long, device=weight.device)
            weight[index] = values.to(device=weight.device, dtype=weight.dtype)
    return meta


def repair_markdown(entry: dict | None) -> str:
    """The model card's lines on untrained template tokens (from run_summary.json's `untrained_tokens`)."""
    if not entry or not entry.get("tokens"):
        return ""
    names = ", ".join(f"`{t}`" for t in entry["tokens"])
    if entry.get("mode") == "ignore":
        return (
            f"The base's rows of {names} look untrained (all zero, constant or far below the other rows' norms) and "
            "were left as they are (`model.untrained_tokens: ignore`); LoRA could not change them."
        )
    text = (
        f"The base's rows of {names} looked untrained (all zero, constant or far below the other rows' norms); "
        "before training they were set to the mean of the trained rows"
    )
    if entry.get("mode") == "train":
        text += " and then trained with the adapter (peft `trainable_token_indices`: the adapter holds their values)."
    else:
        text += (
            f". That is a change to the base, not part of the LoRA adapter: the repaired rows are in `{REPAIR_FILE}`. "
            "Served on the unrepaired base, this adapter reads those tokens as the base's untrained rows: apply them "
            "first (`hf_stable.embeddings.apply_repair(base, '<this directory>')`), or use `hf-stable export`, which "
            "applies them before merging."
        )
    return text
