"""Generation stops where training taught an answer to end: the template's end of turn, not only the EOS.

A tiny Llama memorises one Qwen-style conversation whose template ends turns with ``<|im_end|>`` while the
tokenizer's EOS is ``<|end_of_text|>`` (the Qwen2.5 base situation); exact match and the saved generation config
must stop at ``<|im_end|>``.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast

from hf_stable.config import DataConfig
from hf_stable.data import build_data, encode_prompt, reference_answer
from hf_stable.evaluation import exact_match
from hf_stable.reporting import generation_config, save_generation_config
from tests.helpers import make_tiny_model

QWEN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
RECORD = {"instruction": "What is 6 x 7?", "input": "", "output": "42"}


@pytest.fixture(scope="module")
def im_tok(tokenizer, tmp_path_factory):
    """The tiny tokenizer with a Qwen-style template; EOS stays <|end_of_text|>."""
    path = tmp_path_factory.mktemp("im_tok")
    tokenizer.save_pretrained(path)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def memorised(im_tok, tmp_path_factory):
    """(model, data): a tiny Llama trained on the one sample until it reproduces it."""
    path = tmp_path_factory.mktemp("d") / "t.jsonl"
    path.write_text(json.dumps(RECORD) + "\n", encoding="utf-8")
    data = build_data(DataConfig(train_file=str(path), packing=False, audit=False), im_tok)
    model = make_tiny_model("llama", im_tok)
    batch = data.collator([data.train_dataset[0]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05
    return model.eval(), data


def test_stop_tokens_are_the_turn_end_then_eos(im_tok, memorised):
    _, data = memorised
    assert im_tok.convert_ids_to_tokens(data.stop_token_ids) == ["<|im_end|>", "<|end_of_text|>"]


def test_generation_with_the_stop_tokens_ends_at_the_turn_end(im_tok, memorised):
    model, data = memorised
    prompt = encode_prompt(im_tok, RECORD)
    sample = data.train_dataset[0]["input_ids"]
    assert sample[: len(prompt)] == prompt  # generation is given exactly the training prompt
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=data.stop_token_ids,
            pad_token_id=im_tok.pad_token_id,
        )
    assert out[0, len(prompt) :].tolist() == sample[len(prompt) :]  # "42<|im_end|>", and nothing after it
    em = exact_match(
        model,
        im_tok,
        [RECORD],
        lambda r: encode_prompt(im_tok, r),
        reference_answer,
        stop_token_ids=data.stop_token_ids,
    )
    assert em["exact_match"] == 1.0 and em["examples"][0]["generated"] == "42"


def test_saved_generation_config_lists_turn_end_eos_and_the_base_models_own(im_tok, memorised, tmp_path):
    model, data = memorised
    model.generation_config.eos_token_id = [7, im_tok.eos_token_id]  # a base checkpoint's own stop ids are kept
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.6  # as Qwen2.5's own file
    path = save_generation_config(tmp_path, model, im_tok, data.stop_token_ids)
    saved = GenerationConfig.from_pretrained(path.parent)
    assert saved.eos_token_id == [*data.stop_token_ids, 7] and not saved._from_model_config
    assert saved.pad_token_id == im_tok.pad_token_id and (saved.do_sample, saved.temperature) == (True, 0.6)
    assert model.generation_config.eos_token_id == [7, im_tok.eos_token_id]  # the model's own is not changed
    assert generation_config(None, im_tok, []).eos_token_id == [im_tok.eos_token_id]
