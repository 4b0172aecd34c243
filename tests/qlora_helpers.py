"""A tiny Llama saved once and loaded back in 4-bit NF4 with LoRA on top (bitsandbytes on CPU), for the QLoRA tests.

Its vocabulary is the guard tests' token data's (`guards_common.VOCAB`), so their fault injectors and data apply.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.dist_scripts.guards_common import VOCAB

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_tiny_llama(out: Path, seed: int = 0) -> Path:
    """A random-init Llama (hidden 64, 2 layers, GQA) in `out` (safetensors, fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def load_quantized(path: Path, attn_implementation: str = "sdpa", dtype=torch.float32, **quant):
    """The saved base in 4-bit NF4 (double quant, fp32 compute: exact enough and fast on CPU) on the CPU."""
    from transformers import AutoModelForCausalLM

    from hf_stable.compat import keep_cpu_4bit_layout
    from hf_stable.config.quantization import QuantizationConfig

    q = QuantizationConfig(**{"load_in": "4bit", "compute_dtype": "float32", **quant})
    model = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=q.bnb_config(),
        device_map={"": "cpu"},
        dtype=dtype,
        attn_implementation=attn_implementation,
    )
    keep_cpu_4bit_layout(model)  # as hf_stable.modeling.load_model does
    return model


def quantized_lora_llama(path: Path, seed: int = 0, gradient_checkpointing: bool = False, **quant):
    """`load_quantized` + hf_stable's `apply_lora` (prepare_model_for_kbit_training, then a rank-16 adapter whose B
    starts non-zero so every factor has a gradient from step 1)."""
    from hf_stable.config.model import LoraSection
    from hf_stable.modeling import apply_lora

    model = load_quantized(path, **quant)
    torch.manual_seed(seed)
    model = apply_lora(model, LoraSection(r=16, alpha=32, target_modules=TARGETS), gradient_checkpointing)
    # apply_lora's adapter starts with B = 0 (peft's default); re-init B so the first steps move every factor
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model
