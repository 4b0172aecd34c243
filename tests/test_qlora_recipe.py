"""End to end on a quantized base: the tiny QLoRA recipe trains through scripts/finetune.py, and the 8B / 7B QLoRA
recipes pass `hf-stable doctor` (dry run included) on random-init reduced models of their real shape."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes")

from tests.test_recipe import ROOT, run_recipe, tiny_overrides

pytestmark = pytest.mark.slow

# The real shapes (hidden, MLP, heads, KV heads, vocabulary; untied heads), one decoder layer.
SHAPES = {
    "llama3.1-8b-qlora": ("llama", 4096, 14336, 32, 8, 128256),
    "qwen2.5-7b-qlora": ("qwen2", 3584, 18944, 28, 4, 152064),
}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora")
    proc = run_recipe(
        ["--config", "configs/tiny-qlora.yaml", *tiny_overrides(tmp, steps=8), "--export.merged", "true"]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp / "out", proc


def test_tiny_qlora_recipe_trains_and_saves_the_adapter_alone(qlora_run):
    out, proc = qlora_run
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["train_steps"] == 8 and summary["eval_loss_after"] < summary["eval_loss_before"]
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    rows = json.loads((out / "optimizer_groups.json").read_text())
    assert {r["optimizer"] for r in rows} == {"bitsandbytes.optim.PagedAdamW8bit"}
    assert "optimizer: bitsandbytes.optim.PagedAdamW8bit" in proc.stdout
    resolved = (out / "resolved_config.yaml").read_text()
    assert "load_in: 4bit" in resolved
    card = (out / "README.md").read_text()
    assert "loaded in 4-bit NF4 (with double quantization" in card and "- qlora" in card
    assert "hf-stable export <this directory>" in card and "## Merged export" in card
    path = out / "stability_events.jsonl"  # written when there is an event
    events = [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
    assert not [e for e in events if e["kind"] in ("nonfinite_grad", "nonfinite_loss", "rollback")]
    # 4-bit on CPU is where bitsandbytes' fused kernel would run: our one line replaces its import-time warning
    assert "Failed to load CPU gemm_4bit_forward" not in proc.stdout + proc.stderr
    assert (proc.stderr.count("`pip install kernels`") == 1) == _bnb_tried_the_kernel()


def _bnb_tried_the_kernel() -> bool:
    """Whether bitsandbytes' import tries the optional kernel here (a CPU with AVX512-BF16, `kernels` missing)."""
    import importlib.util

    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16()) and importlib.util.find_spec("kernels") is None


def test_tiny_qlora_export_merges_into_the_dequantized_base_and_reports_the_16bit_difference(qlora_run):
    """The adapter trained against the dequantized NF4 weights: merged into those, the float32 export reproduces the
    trained model; merged into the original weights it would differ by the quantization error, reported."""
    out, _ = qlora_run
    check = json.loads((out / "merged" / "export_check.json").read_text())
    assert check["passed"] and check["max_abs_logit_diff"] < 1e-5 and check["mean_kl"] < 1e-7
    assert check["generations_equal"] == check["generations_total"] == 16
    assert not check["config_has_quantization_config"]
    q = check["qlora"]
    assert q["merged_into"] == "dequantized" and q["mean_abs_logit_diff"] > 100 * check["max_abs_logit_diff"]
    config = json.loads((out / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    assert "4-bit weights the adapter trained" in (out / "merged" / "README.md").read_text()


def _reduced_base(out: Path, arch: str, hidden: int, inter: int, heads: int, kv: int, vocab: int) -> Path:
    """A random-init 1-layer model of the real shape, in bf16, written by a subprocess (its memory goes with it).

    The tensors' names and shapes come from the model built on the meta device; their values are slices of one
    seeded N(0, 0.02) pool (norms 1, biases 0): a from_config init of 1.3B parameters takes a minute on one core."""
    code = f"""
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen2Config, AutoModelForCausalLM
cls = {{"llama": LlamaConfig, "qwen2": Qwen2Config}}["{arch}"]
config = cls(hidden_size={hidden}, intermediate_size={inter}, num_hidden_layers=1, num_attention_heads={heads},
             num_key_value_heads={kv}, vocab_size={vocab}, tie_word_embeddings=False, max_position_embeddings=4096,
             dtype="bfloat16")
with torch.device("meta"):
    shapes = {{k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}}
pool = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(torch.bfloat16)
tensors, offset = {{}}, 0
for name, shape in shapes.items():
    n = shape.numel()
    if "norm" in name or name.endswith(".bias"):
        tensors[name] = (torch.ones if "norm" in name else torch.zeros)(shape, dtype=torch.bfloat16)
        continue
    start = offset % pool.numel()  # each tensor starts at another place in the pool
    walk = torch.cat([pool[start:], pool[:start]])
    tensors[name], offset = walk.repeat(-(-n // walk.numel()))[:n].view(shape).clone(), offset + 104729
config.save_pretrained("{out}")
save_file(tensors, "{out}/model.safetensors", metadata={{"format": "pt"}})
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    return out


@pytest.fixture
def scratch(tmp_path):
    """Where the 2.5 GB reduced checkpoint goes: RAM (/dev/shm) when it has room (disk writes are the slow part)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 12 * 1024**3:
        path = Path(tempfile.mkdtemp(prefix="hf_stable_qlora_", dir=shm))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path


# a 7B-shaped layer: on a CPU without native bf16 the doctor's dry run computes in fp32 (a bf16 step there took
# 292 s), so the base build and the doctor take 1-3 min on 2 cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe", sorted(SHAPES))
def test_8b_and_7b_qlora_recipes_pass_the_doctor_on_a_reduced_model_of_their_shape(tmp_path, scratch, recipe):
    base = _reduced_base(scratch / "base", *SHAPES[recipe])
    overrides = tiny_overrides(tmp_path, steps=2)  # the embedded data and a tiny base for its tokenizer
    cache = Path(overrides[overrides.index("--model.embedded.cache_dir") + 1])
    from hf_stable.config import EmbeddedBaseConfig
    from hf_stable.embedded.builder import ensure_base

    embedded = ensure_base(
        "llama",
        EmbeddedBaseConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            vocab_size=512,
            pretrain_steps=0,
            cache_dir=str(cache),
        ),
    )
    data = [overrides[overrides.index(k) + 1] for k in ("--data.train_file", "--data.eval_file")]
    argv = ["--config", f"configs/{recipe}.yaml", "--model.name_or_path", str(base)]
    argv += [
        "--model.tokenizer",
        str(embedded / "tokenizer"),
        "--data.train_file",
        data[0],
        "--data.eval_file",
        data[1],
    ]
    argv += ["--data.max_length", "64", "--training.per_device_train_batch_size", "1"]
    argv += ["--training.gradient_accumulation_steps", "1", "--doctor_checks.dry_run_steps", "2"]
    argv += ["--training.warmup_steps", "0"]  # LoRA B starts at 0: A's first gradient comes with step 2
    argv += ["--doctor_checks.memory_probe", "false"]  # the estimate is what this test is about; the probe is slow
    argv += ["--training.output_dir", str(tmp_path / "out"), "--training.report_to", "none", "--json"]
    if not torch.cuda.is_available():  # the recipes' bf16 on a CPU machine needs use_cpu (TrainingArguments)
        argv += ["--training.use_cpu", "true"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_stable.cli", "doctor", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert "{" in proc.stdout, proc.stderr[-4000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    findings = report["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    assert proc.returncode == 0 and not errors, errors or proc.stderr[-4000:]
    (memory,) = [f for f in findings if f["check"] == "hazards.memory_estimate"]
    assert memory["severity"] == "info" and "fits" in memory["what"] and "base in 4bit nf4" in memory["evidence"]
    assert "quantized weights" in memory["evidence"] and "optimizer state" in memory["evidence"]
    from hf_stable.precision import cpu_has_fast_bf16

    slow_bf16 = not torch.cuda.is_available() and not cpu_has_fast_bf16()
    precision = [f for f in findings if f["check"] == "dry_run.precision"]
    assert len(precision) == slow_bf16 and all("compute_dtype=bfloat16" in f["evidence"] for f in precision)
    warned = [f for f in findings if f["check"] == "environment.precision" and "native bf16" in f["what"]]
    assert len(warned) == slow_bf16 and all(f["severity"] == "warning" for f in warned)
    dry = report["facts"]["dry_run"]  # two real optimizer steps on the quantized model
    assert dry["steps"] == 2 and all(math.isfinite(loss) for loss in dry["losses"]), dry


def test_the_qlora_adapter_merges_into_the_unquantized_base(qlora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, _ = qlora_run
    base_path = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), str(out)).eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_path).eval()(input_ids=ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4) and not torch.allclose(adapted, plain, atol=1e-3)
