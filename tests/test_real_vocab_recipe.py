"""One recipe run with the real 128k Llama-3 vocabulary: a random-init Llama (tiny hidden size) and the Llama-3.1
Instruct tokenizer and template, through data, the doctor, training, the memory monitor, exact match and outputs."""

from __future__ import annotations

import json

import pytest

from tests.test_recipe import run_recipe

pytestmark = pytest.mark.slow


def _records(n: int, offset: int) -> list[dict]:
    rows = []
    for k in range(n):
        a, b = offset + k, 2 * k + 1
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
        if k % 3 == 1:
            messages.insert(0, {"role": "system", "content": "Answer with a number."})
        if k % 3 == 2:
            messages = [
                {"role": "user", "content": f"{a} 加 {b} 等于多少？"},
                {"role": "assistant", "content": str(a + b)},
            ]
        rows.append({"messages": messages})
    return rows


@pytest.fixture(scope="module")
def llama_128k_run(real_tokenizer, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = real_tokenizer("llama3.1-instruct")
    tmp = tmp_path_factory.mktemp("llama128k")
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|end_of_text|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    # as Llama-3.1-8B-Instruct's own generation_config.json: <|end_of_text|>, <|eom_id|>, <|eot_id|>
    model.generation_config.eos_token_id = [128001, 128008, 128009]
    model.save_pretrained(tmp / "base")
    tok.save_pretrained(tmp / "base")
    for name, rows in (("train", _records(32, 10)), ("eval", _records(8, 60))):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    args = ["--model.name_or_path", str(tmp / "base"), "--model.dtype", "float32"]
    args += ["--data.train_file", str(tmp / "train.jsonl"), "--data.eval_file", str(tmp / "eval.jsonl")]
    args += ["--data.max_length", "96", "--training.max_steps", "3", "--training.per_device_train_batch_size", "4"]
    args += ["--training.logging_steps", "1", "--training.output_dir", str(tmp / "out")]
    args += ["--evaluation.exact_match_samples", "4", "--evaluation.max_new_tokens", "4"]
    args += ["--doctor", "true"]  # its dry run and memory probe on the 128k-row embeddings
    proc = run_recipe(args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp / "out", tok


def test_the_real_vocabulary_goes_through_the_whole_pipeline(llama_128k_run):
    out, _ = llama_128k_run
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["train_steps"] == 3 and summary["exact_match_after"] is not None
    assert summary["n_parameters"] > 2 * 128257 * 32  # embeddings and lm_head of the real vocabulary
    logs = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert any(row.get("mem/rss_gib", 0) > 0 for row in logs)  # the memory monitor saw the run
    assert (out / "doctor_report.md").is_file()


def test_samples_and_stop_tokens_follow_the_llama31_template(llama_128k_run):
    out, _ = llama_128k_run
    audit = json.loads((out / "data_audit.json").read_text())["train"]
    assert audit["stop_tokens"] == ["<|eot_id|>"] and audit["eos_coverage"] == 1.0
    marked = audit["sample"]["marked"]
    assert marked.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert marked.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n⟦11<|eot_id|>⟧")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [128009, 128001, 128008]  # the turn end first, the base model's own kept
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "⟦11<|eot_id|>⟧" in card and "Training taught answers to end with `<|eot_id|>`" in card
