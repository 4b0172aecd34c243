"""Config section `model.quantization`: load the frozen base in 4-bit (NF4/FP4) or 8-bit through bitsandbytes.

QLoRA (Dettmers et al., arXiv 2305.14314): the base weights are stored quantized and dequantized to
`compute_dtype` for each matmul; only the LoRA adapters train, in full precision. What cannot work is refused when
the config is loaded (`problems`), before an 8B base is read: a full fine-tune (quantized weights have no
gradients), no bitsandbytes installed, QK-clip over quantized q/k projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_stable.config.fields import help_ as _h

# bitsandbytes never quantizes these (transformers keeps the output head in full precision by default)
ALWAYS_SKIPPED = ("lm_head",)


@dataclass
class QuantizationConfig:
    """How the base model is quantized at load time (`transformers.BitsAndBytesConfig`).

    Example:
        >>> QuantizationConfig(load_in="4bit", quant_type="nf4", compute_dtype="bfloat16").validate()
        []
    """

    load_in: Literal["none", "4bit", "8bit"] = field(
        default="none",
        metadata=_h(
            "Quantize the frozen base at load time: 4bit (QLoRA: NF4/FP4 blocks of 64), 8bit (LLM.int8), "
            "none. Needs the bitsandbytes extra and lora.enabled."
        ),
    )
    quant_type: Literal["nf4", "fp4"] = field(
        default="nf4", metadata=_h("4-bit data type: nf4 (normal-float, QLoRA's choice) or fp4.")
    )
    double_quant: bool = field(
        default=True,
        metadata=_h("4-bit: quantize the per-block scales too (about 0.37 bits/parameter less, QLoRA's default)."),
    )
    compute_dtype: Literal["bfloat16", "float16", "float32"] = field(
        default="bfloat16",
        metadata=_h("Dtype the 4-bit weights are dequantized to for each matmul (match training.bf16/fp16)."),
    )
    upcast_fp32: bool = field(
        default=True,
        metadata=_h(
            "Cast the weights left in 16 bits (embeddings, lm_head, norms) to fp32, as peft's "
            "prepare_model_for_kbit_training does. false keeps model.dtype: under bf16/fp16 autocast the head's matmul "
            "runs in 16 bits either way, and a 128k-vocabulary model saves ~2 GiB plus autocast's copy of the head."
        ),
    )
    skip_modules: list[str] = field(
        default_factory=list,
        metadata=_h("Modules kept in full precision besides lm_head (bitsandbytes' llm_int8_skip_modules)."),
    )

    @property
    def enabled(self) -> bool:
        return self.load_in != "none"

    def quantizes(self, module: str) -> bool:
        """Whether a Linear named `module` (full dotted name or leaf) is stored quantized."""
        parts = module.split(".")
        return self.enabled and not any(s in parts for s in (*ALWAYS_SKIPPED, *self.skip_modules))

    def validate(self) -> list[str]:
        problems = []
        if self.load_in == "8bit" and self.quant_type != "nf4":
            problems.append(f"quant_type: got {self.quant_type!r}; it applies to load_in: 4bit only")
        return problems

    def bnb_config(self):
        """The `transformers.BitsAndBytesConfig` for this section (None when off)."""
        if not self.enabled:
            return None
        import torch
        from transformers import BitsAndBytesConfig

        skip = [*ALWAYS_SKIPPED, *self.skip_modules]
        if self.load_in == "8bit":
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
            llm_int8_skip_modules=skip,
        )


def quantization_problems(cfg) -> list[str]:
    """Cross-section problems of a quantized base (or of an 8-bit optimizer) that no training could get past."""
    from hf_stable.import_utils import is_bitsandbytes_available

    q = cfg.model.quantization
    out = []
    eight_bit = cfg.optim.name.endswith("_8bit")
    if (q.enabled or eight_bit) and not is_bitsandbytes_available():
        what = f"model.quantization.load_in: {q.load_in}" if q.enabled else f"optim.name: {cfg.optim.name}"
        out.append(f'{what} needs bitsandbytes, which is not installed: pip install "hf-stable[bitsandbytes]"')
    if not q.enabled:
        return out
    if not cfg.lora.enabled:
        out.append(
            f"lora.enabled: false with model.quantization.load_in: {q.load_in}; quantized weights have no "
            "gradients, so a full fine-tune cannot train them: set lora.enabled: true, or load_in: none"
        )
    if cfg.attention.qk_clip and (q.quantizes("q_proj") or q.quantizes("k_proj")):
        out.append(
            f"attention.qk_clip: true with model.quantization.load_in: {q.load_in}; q_proj/k_proj are quantized "
            "(as with sharded weights, QK-clip needs their full-precision values): set attention.qk_clip: false, "
            "or keep them unquantized (model.quantization.skip_modules: [q_proj, k_proj])"
        )
    if cfg.model.dtype == "float16" and q.compute_dtype == "bfloat16":
        out.append("model.quantization.compute_dtype: bfloat16 with model.dtype: float16; use one 16-bit type")
    return out
