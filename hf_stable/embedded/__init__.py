from hf_stable.embedded.builder import build_base, ensure_base, tiny_model_config
from hf_stable.embedded.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_base", "ensure_base", "tiny_model_config", "train_tokenizer"]
