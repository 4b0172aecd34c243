"""The reference a merged export is verified against, recorded at the end of training by the model as trained.

On up to `export.reference_prompts` held-out samples (the eval set, rendered and labelled as in training; without an
eval file, the last train samples: the check compares two models on the same inputs, so membership does not bias
it) it keeps, for each answer position (a position whose next label is supervised), the top-k logits, their token
ids and the logsumexp over the whole vocabulary, and the greedy generation (batch of one, no padding) from the
sample's prompt under the run's generation config, stopping at its stop tokens. Plus the fingerprint of the base
weights on disk (`hf_stable.export.fingerprint`). All of it goes into one `export_reference.safetensors`; top-k rather
than full rows keeps it under a megabyte at a 128k vocabulary (32 prompts x ~30 positions x k=64).

`hf_stable.export.verify` reads it back with `read_reference` in a process that has only transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE_FILE = "export_reference.safetensors"
IGNORE_INDEX = -100


def answer_positions(labels: list[int]) -> list[int]:
    """Positions whose logits predict a supervised token (the causal shift: position p predicts label p + 1)."""
    return [p for p in range(len(labels) - 1) if labels[p + 1] != IGNORE_INDEX]


def reference_samples(data, n: int) -> tuple[list[dict], str]:
    """Up to `n` (input_ids, labels) samples and where they come from ("eval" or "train")."""
    if data.eval_dataset is not None and len(data.eval_dataset):
        ds, source = data.eval_dataset, "eval"
        rows = range(min(n, len(ds)))
    else:
        ds, source = data.train_dataset, "train"
        rows = range(max(0, len(ds) - n), len(ds))
    out = []
    for i in rows:
        row = ds[i]
        if answer_positions(row["labels"]):
            out.append({"input_ids": list(row["input_ids"]), "labels": list(row["labels"])})
    return out, source


def greedy_config(generation_config, max_new_tokens: int):
    """`generation_config` made greedy, with `max_new_tokens` (what the reference and the verification both run)."""
    import copy

    config = copy.deepcopy(generation_config)
    config.do_sample = False
    config.num_beams = 1
    config.max_new_tokens = int(max_new_tokens)
    config.max_length = None
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if hasattr(config, name):
            setattr(config, name, None)
    return config


def model_outputs(model, samples: list[dict], generation_config, top_k: int):
    """Per sample: top-k logits / ids and logsumexp at its answer positions, and its greedy generation.

    Shared by the recording (the trained PEFT model) and the verification (the merged checkpoint), so both run the
    same forwards: batch of one, no padding, `use_cache=False` for the logits.
    """
    import torch

    device = next(model.parameters()).device
    values, indices, lse, generations = [], [], [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["input_ids"]], device=device)
            pos = torch.tensor(answer_positions(s["labels"]), device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0, pos].float()
            k = min(top_k, logits.shape[-1])
            top = logits.topk(k, dim=-1)
            values.append(top.values.cpu())
            indices.append(top.indices.to(torch.int32).cpu())
            lse.append(torch.logsumexp(logits, dim=-1).cpu())
            n_prompt = next(i for i, label in enumerate(s["labels"]) if label != IGNORE_INDEX)
            prompt = ids[:, :n_prompt]
            out = model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=generation_config
            )
            generations.append(out[0, n_prompt:].tolist())
    return values, indices, lse, generations


def _flat(rows: list[list[int]]):
    import torch

    offsets = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()], dtype=torch.int64)
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    return flat, offsets


def _unflat(flat, offsets) -> list[list[int]]:
    o = offsets.tolist()
    values = flat.tolist()
    return [values[o[i] : o[i + 1]] for i in range(len(o) - 1)]


def record_reference(model, tokenizer, data, export_cfg, output_dir, *, stop_token_ids, base_fingerprint) -> Path:
    """Write `output_dir/export_reference.safetensors` from the trained `model` (call on the main process).

    Args:
        model: the model as trained (the PEFT model; put in eval mode for the recording, then restored).
        data: the run's `DataBundle` (eval samples, or the train samples without an eval file).
        export_cfg: the run's `ExportConfig` (`reference_prompts`, `reference_top_k`, `max_new_tokens`).
        stop_token_ids: what generation stops at (`DataBundle.stop_token_ids`).
        base_fingerprint: `weights_fingerprint` of the base the adapter was trained on (None: not available).
    """
    import torch
    from safetensors.torch import save_file

    from hf_stable.reporting.generation_config import generation_config

    samples, source = reference_samples(data, export_cfg.reference_prompts)
    gen = greedy_config(generation_config(model, tokenizer, stop_token_ids), export_cfg.max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        values, indices, lse, generations = model_outputs(model, samples, gen, export_cfg.reference_top_k)
    finally:
        model.train(was_training)
    input_ids, input_offsets = _flat([s["input_ids"] for s in samples])
    labels, _ = _flat([s["labels"] for s in samples])
    gen_ids, gen_offsets = _flat(generations)
    tensors = {
        "input_ids": input_ids,
        "labels": labels,
        "input_offsets": input_offsets,
        "topk_values": torch.cat(values).contiguous(),
        "topk_indices": torch.cat(indices).contiguous(),
        "logsumexp": torch.cat(lse).contiguous(),
        "generated_ids": gen_ids,
        "generated_offsets": gen_offsets,
    }
    meta = {
        "source": source,
        "n_prompts": len(samples),
        "n_positions": int(tensors["logsumexp"].numel()),
        "top_k": int(tensors["topk_values"].shape[-1]),
        "max_new_tokens": export_cfg.max_new_tokens,
        "stop_token_ids": [int(t) for t in gen.eos_token_id],
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "base_fingerprint": base_fingerprint,
    }
    path = Path(output_dir) / REFERENCE_FILE
    save_file(tensors, str(path), metadata={"hf_stable_reference": json.dumps(meta)})
    return path


def read_reference(path) -> tuple[dict, list[dict], dict]:
    """(meta, samples, tensors) of a reference file: samples as `{"input_ids", "labels", "generated"}`; tensors hold
    `topk_values` / `topk_indices` / `logsumexp` over all answer positions, in sample order."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["hf_stable_reference"])
        names = handle.keys()
        t = {name: handle.get_tensor(name) for name in names}
    ids = _unflat(t["input_ids"], t["input_offsets"])
    labels = _unflat(t["labels"], t["input_offsets"])
    generated = _unflat(t["generated_ids"], t["generated_offsets"])
    samples = [{"input_ids": i, "labels": la, "generated": g} for i, la, g in zip(ids, labels, generated, strict=True)]
    return meta, samples, {k: t[k] for k in ("topk_values", "topk_indices", "logsumexp")}


def record_after_training(model, tokenizer, data, cfg, output_dir, base: str) -> Path | None:
    """The recipe's recording (every rank calls it; the main process records): None when `export.reference` is off,
    for a full fine-tune (nothing to merge), or when the engine shards the parameters (a forward on one rank alone
    cannot run; the export then says there is no reference)."""
    from hf_stable.evaluation import sharded_parameters
    from hf_stable.export.fingerprint import base_directory, weights_fingerprint
    from hf_stable.logging import get_logger, is_main_process

    if not cfg.export.reference or not cfg.lora.enabled:
        return None
    sharded = sharded_parameters(model)
    if sharded is not None:
        get_logger(__name__).warning(
            "export.reference: not recorded: %s shards the parameters across ranks, so rank 0 cannot run the "
            "trained model alone; `hf-stable export` needs the reference",
            sharded,
        )
        return None
    if not is_main_process():
        return None
    directory = base_directory(base, cfg.model.revision)
    fingerprint = weights_fingerprint(directory) if directory is not None else None
    path = record_reference(
        model,
        tokenizer,
        data,
        cfg.export,
        output_dir,
        stop_token_ids=data.stop_token_ids,
        base_fingerprint=fingerprint,
    )
    get_logger(__name__).info("export reference: %s", path)
    return path
