"""Config sections for the base model, the embedded tiny base, and LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_stable.config.quantization import QuantizationConfig

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass
class EmbeddedBaseConfig:
    """The tiny base checkpoint built locally (seeded) when `model.name_or_path` starts with `embedded:`."""

    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    intermediate_size: int = field(default=352, metadata={"help": "MLP width."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Decoder layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Query heads."})
    num_key_value_heads: int = field(default=2, metadata={"help": "KV heads (GQA when fewer than query heads)."})
    vocab_size: int = field(default=1024, metadata={"help": "Upper bound for the BPE tokenizer's vocabulary."})
    max_position_embeddings: int = field(default=512, metadata={"help": "Longest position the model supports."})
    pretrain_steps: int = field(
        default=300, metadata={"help": "Steps of causal-LM pretraining on the embedded corpus."}
    )
    pretrain_lr: float = field(default=3e-3, metadata={"help": "Pretraining learning rate (AdamW, cosine)."})
    pretrain_batch_size: int = field(default=32, metadata={"help": "Pretraining batch size (sequences)."})
    pretrain_seq_len: int = field(default=64, metadata={"help": "Pretraining sequence length (tokens)."})
    seed: int = field(default=1234, metadata={"help": "Seed of tokenizer, init, corpus and pretraining."})
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "Where built bases are cached (default $HF_STABLE_CACHE or ~/.cache/hf_stable/bases)."},
    )

    def validate(self) -> list[str]:
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}: got {getattr(self, name)}, must be > 0")
        if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size: {self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_key_value_heads <= 0 or self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append(
                f"num_key_value_heads: got {self.num_key_value_heads}, must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.vocab_size < 300:
            problems.append(f"vocab_size: got {self.vocab_size}, must be >= 300 (256 bytes + special tokens)")
        if self.pretrain_steps < 0:
            problems.append(f"pretrain_steps: got {self.pretrain_steps}, must be >= 0")
        return problems


@dataclass
class ModelConfig:
    """Which base model to fine-tune and how to load it."""

    name_or_path: str = field(
        default="embedded:tiny-llama",
        metadata={"help": "Hub id, local directory, or 'embedded:<name>' for the locally built tiny base."},
    )
    embedded: EmbeddedBaseConfig = field(default_factory=EmbeddedBaseConfig)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "Dtype the base weights are loaded in."}
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer path or id when it differs from name_or_path."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Passed to from_pretrained."})
    revision: str | None = field(default=None, metadata={"help": "Hub revision (branch, tag or commit)."})
    quantization: QuantizationConfig = field(
        default_factory=QuantizationConfig,
        metadata={"help": "Load the frozen base in 4-bit / 8-bit through bitsandbytes (QLoRA)."},
    )
    start_from: str | None = field(
        default=None,
        metadata={
            "help": "stage dpo / grpo: an earlier stage's output dir (its LoRA adapter is trained further on "
            "model.name_or_path, the same base) or its merged export (the new base of a fresh adapter)."
        },
    )
    untrained_tokens: Literal["repair", "train", "ignore"] = field(
        default="train",
        metadata={
            "help": "Special tokens the data uses whose embedding / lm_head rows look untrained (zero, constant, "
            "far below the other rows' norms): 'repair' sets them to the trained rows' mean before LoRA (saved in "
            "untrained_token_repair.safetensors, applied by hf-stable export); 'train' repairs, then trains them "
            "(peft trainable_token_indices); 'ignore' only warns."
        },
    )

    @property
    def is_embedded(self) -> bool:
        return self.name_or_path.startswith(EMBEDDED_PREFIX)

    @property
    def embedded_arch(self) -> str:
        """'llama', 'qwen2' or 'qwen3' for `embedded:tiny-<arch>`."""
        return self.name_or_path[len(EMBEDDED_PREFIX) :].removeprefix("tiny-")

    def validate(self) -> list[str]:
        if self.is_embedded and self.embedded_arch not in EMBEDDED_ARCHS:
            allowed = ", ".join(f"{EMBEDDED_PREFIX}tiny-{a}" for a in EMBEDDED_ARCHS)
            return [f"name_or_path: got {self.name_or_path!r}, embedded bases are: {allowed}"]
        return []


@dataclass
class LoraSection:
    """LoRA adapter settings, passed to peft's `LoraConfig`."""

    enabled: bool = field(default=True, metadata={"help": "Train a LoRA adapter; false = full fine-tune."})
    r: int = field(default=16, metadata={"help": "LoRA rank."})
    alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scaling = alpha / r)."})
    dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "Module names LoRA wraps (peft semantics: suffix match)."},
    )
    use_dora: bool = field(default=False, metadata={"help": "DoRA (weight-decomposed LoRA)."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised scaling alpha/sqrt(r)."})

    def validate(self) -> list[str]:
        problems = []
        if self.r <= 0:
            problems.append(f"r: got {self.r}, must be > 0")
        if self.alpha <= 0:
            problems.append(f"alpha: got {self.alpha}, must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout: got {self.dropout}, must be in [0, 1)")
        if self.enabled and not self.target_modules:
            problems.append("target_modules: empty, name at least one module (e.g. q_proj)")
        return problems
