"""Config section `export`: the reference recorded at the end of training, and the merged export.

Example (YAML):
    export:
      merged: true         # write output_dir/merged: base + LoRA merged, loadable by from_pretrained alone
      dtype: bfloat16
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_stable.config.fields import help_ as _h

EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ExportConfig:
    """What the recipe records for `hf-stable export` and whether it exports a merged checkpoint itself."""

    merged: bool = field(
        default=False,
        metadata=_h(
            "At the end of training, rank 0 merges the LoRA adapter into the base, saves a standalone checkpoint "
            "(`out`) and verifies it in a fresh process against the reference; the other ranks wait. A failed "
            "export is a failed run. Same as `hf-stable export OUTPUT_DIR` afterwards."
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata=_h(
            "Dtype of the merged weights (the merge itself is done in float32, then cast once). auto: the dtype "
            "the base checkpoint is stored in (its config.json `dtype`), float32 when it names none."
        ),
    )
    out: str | None = field(
        default=None, metadata=_h("Directory of the merged checkpoint (default: <training.output_dir>/merged).")
    )
    qlora_base: Literal["dequantized", "original"] = field(
        default="dequantized",
        metadata=_h(
            "QLoRA only: merge into the dequantized 4-bit weights the adapter was trained against (dequantized), "
            "or into the original 16-bit base (original). Either way the measured logit difference between the two "
            "is reported."
        ),
    )
    reference: bool = field(
        default=True,
        metadata=_h(
            "Record `export_reference.safetensors` at the end of training (LoRA runs): the trained model's "
            "answer-position logits (top-k + logsumexp) and greedy generations on held-out prompts, and a "
            "fingerprint of the base weights; the export is verified against it."
        ),
    )
    reference_prompts: int = field(
        default=32, metadata=_h("Held-out prompts in the reference (eval records; without an eval file, train ones).")
    )
    reference_top_k: int = field(
        default=64, metadata=_h("Logits kept per answer position (the top k and the logsumexp of all).")
    )
    max_new_tokens: int = field(default=16, metadata=_h("Greedy generation budget per reference prompt."))

    def validate(self) -> list[str]:
        problems = []
        for name in ("reference_prompts", "reference_top_k", "max_new_tokens"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}: got {getattr(self, name)}, must be > 0")
        if self.merged and not self.reference:
            problems.append("reference: false with merged: true; the export is verified against the reference")
        return problems
