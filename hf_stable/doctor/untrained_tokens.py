"""The doctor's untrained-token check: name the template tokens whose base rows look untrained, and what the recipe
will do about them (`model.untrained_tokens`; the rule is in `hf_stable.embeddings.untrained`).

In the recipe the rows were checked (and repaired) before LoRA, and that result is passed in. `hf-stable doctor`
on its own has no weights loaded (it builds the model on the meta device): it reads only the input-embedding and
lm_head tensors from the base's safetensors files.
"""

from __future__ import annotations

from hf_stable.doctor.findings import Finding

CHECK = "hazards.untrained_tokens"

_ACTION = {
    "repair": "the recipe sets them to the mean of the trained rows before LoRA (model.untrained_tokens: repair), "
    "saves the repaired rows next to the adapter and `hf-stable export` applies them",
    "train": "the recipe sets them to the mean of the trained rows, then trains them with the adapter "
    "(model.untrained_tokens: train, peft trainable_token_indices)",
    "ignore": "set model.untrained_tokens: repair (or train); with `ignore` LoRA cannot change these rows, so the model "
    "can neither read nor learn the tokens the conversation format hangs on",
}


def rows_from_disk(base: str, meta, revision: str | None = None) -> dict | None:
    """{"input_embedding": tensor, "lm_head": tensor when untied} read from `base`'s safetensors files, named by the
    meta-device model `meta`; None when the checkpoint is not on disk as safetensors."""
    from safetensors import safe_open

    from hf_stable.export.fingerprint import base_directory

    directory = base_directory(base, revision)
    if directory is None or meta is None:
        return None
    names = {n: m for n, m in meta.named_modules()}
    wanted = {"input_embedding": meta.get_input_embeddings()}
    tied = bool(getattr(meta.config, "tie_word_embeddings", False))
    if not tied and meta.get_output_embeddings() is not None:
        wanted["lm_head"] = meta.get_output_embeddings()
    keys = {matrix: next(n for n, m in names.items() if m is module) + ".weight" for matrix, module in wanted.items()}
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            stored = set(f.keys())
            for matrix, key in keys.items():
                # checkpoints saved from a bare base model lack the "model." prefix the CausalLM names carry
                for name in (key, key.removeprefix("model.")):
                    if name in stored and matrix not in out:
                        out[matrix] = f.get_tensor(name)
    return out if "input_embedding" in out else None


def untrained_findings(found, mode: str) -> list[Finding]:
    """One finding: the untrained rows and what will be done, or that the special tokens' rows look trained."""
    if found is None:
        return []
    if not found.candidates:
        return [Finding("ok", "untrained tokens: the data uses no special token", check=CHECK)]
    checked = ", ".join(found.candidates.values())
    if not found.rows:
        return [
            Finding(
                "ok",
                "the special tokens the data uses have trained embedding rows",
                f"checked {checked} in {' and '.join(found.stats) or 'no matrix'}",
                check=CHECK,
            )
        ]
    names = ", ".join(found.names())
    return [
        Finding(
            "warning" if mode == "ignore" else "info",
            f"untrained embedding rows for {names}",
            found.describe(),
            _ACTION.get(mode, _ACTION["repair"]),
            check=CHECK,
        )
    ]


def check_untrained_tokens(cfg, *, model=None, base=None, meta=None, tokenizer=None, data=None) -> list[Finding]:
    """Run the check on the loaded model, or on the rows read from disk (no model loaded)."""
    from hf_stable.embeddings import embedding_matrices, find_untrained_tokens, used_special_tokens

    if tokenizer is None or data is None:
        return []
    mode = cfg.model.untrained_tokens
    matrices = embedding_matrices(model) if model is not None else rows_from_disk(base, meta, cfg.model.revision)
    if matrices is None:
        return [
            Finding(
                "info",
                "untrained tokens: not checked (the base's weights are not on disk as safetensors)",
                str(base),
                check=CHECK,
            )
        ]
    return untrained_findings(
        find_untrained_tokens(matrices, tokenizer, used_special_tokens(tokenizer, data), mode), mode
    )
