"""The README's Python examples run as written: each ```python block is executed with a tiny local model in place
of the Hub checkpoint it names (and the few other substitutions below, each of which must still match the text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import GenerationConfig

from tests.helpers import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
HUB_MODEL = '"Qwen/Qwen2.5-0.5B-Instruct"'


def python_blocks() -> list[str]:
    return re.findall(
        r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE
    )


@pytest.fixture(scope="module")
def tiny_hub_model(tokenizer, tmp_path_factory) -> Path:
    """A random-init tiny Qwen2 with the tests' tokenizer, saved as a Hub checkpoint directory is."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_tiny_model("qwen2", tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def substitutions(model_dir: Path) -> dict[str, str]:
    return {
        HUB_MODEL: repr(str(model_dir)),
        '"configs/qwen2.5-0.5b-lora.yaml"': repr(str(ROOT / "configs/qwen2.5-0.5b-lora.yaml")),  # run from a tmp dir
        "max_steps=1000": "max_steps=2",
    }


def test_readme_has_the_examples_this_test_runs():
    blocks = python_blocks()
    assert len(blocks) == 3 and all(HUB_MODEL in b for b in blocks)
    assert all("from transformers import" in b for b in blocks[1:])  # self-contained: nothing from the one before


def test_readme_python_blocks_run_as_written(tiny_hub_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for n, block in enumerate(python_blocks()):
        for old, new in substitutions(tiny_hub_model).items():
            if old in block:
                block = block.replace(old, new)
        assert "Qwen/" not in block, f"README block {n} names a Hub model the test does not substitute"
        namespace: dict = {"__name__": f"readme_block_{n}"}
        exec(compile(block, f"README.md python block {n}", "exec"), namespace)  # noqa: S102 - the README's own code
        if n == 0:
            trainer, data, hook = namespace["trainer"], namespace["data"], namespace["my_callback"]
            assert trainer.state.global_step == 2 and hook.params_with_grad > 0
            assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
            saved = GenerationConfig.from_pretrained(tmp_path / "out")
            assert saved.eos_token_id == data.stop_token_ids == [namespace["tokenizer"].eos_token_id]
            assert data.audit["train"]["sample"]["marked"].endswith("<|end_of_text|>⟧")
        elif n == 1:
            assert namespace["model"].config._attn_implementation == "hf_stable"
        else:
            _train_with_the_chunked_loss_trainer(namespace, tmp_path)


def _train_with_the_chunked_loss_trainer(namespace: dict, tmp_path: Path) -> None:
    """The stock-Trainer example of the chunked loss trains, and its steps call the head on chunks ([rows, H])."""
    import torch
    from transformers import TrainingArguments

    model, ranks = namespace["model"], []
    model.lm_head.register_forward_hook(lambda m, a, o: ranks.append(a[0].dim()))
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(
        tmp_path / "chunked", max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    trainer = namespace["ChunkedLossTrainer"](model=model, args=args, train_dataset=rows)
    trainer.train()
    assert trainer.state.global_step == 2 and ranks == [2] * 4  # per step: the forward and the backward's recompute
