"""A byte-level BPE tokenizer trained offline, with special tokens and a chat template.

Used by the embedded default base and by the tests; no Hub access needed.
"""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS = ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>", "<|assistant|>"]

# Each turn: role marker, newline, content, newline; the assistant turn ends with EOS instead.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024, pad_equals_eos: bool = False):
    """Train a byte-level BPE on `texts` and wrap it in a `PreTrainedTokenizerFast`.

    Args:
        texts: training corpus.
        vocab_size: upper bound; a small corpus may give fewer merges.
        pad_equals_eos: make `pad_token` the EOS token (the Llama-3 habit that breaks naive collators).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>" if pad_equals_eos else "<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        padding_side="right",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
