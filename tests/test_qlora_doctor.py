"""The doctor over a quantized base: the memory estimate (4-bit / 8-bit weights as stored, 8-bit optimizer state,
the fp32 upcast of what stays unquantized, the largest consumer) and the dry run on the tiny QLoRA recipe."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

from hf_stable.config import load_config
from tests.qlora_helpers import quantized_lora_llama, save_tiny_llama


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("qbase"))


# --- the doctor's memory estimate ---------------------------------------------------------------------------------


def _meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_memory_estimate_counts_4bit_weights_and_8bit_state_for_the_8b_recipe():
    from transformers import LlamaConfig

    from hf_stable.config.doctor import DoctorConfig
    from hf_stable.doctor.memory_estimate import GIB, estimate_memory, memory_findings
    from hf_stable.doctor.settings import resolve_settings

    # Llama-3.1-8B's shape on the meta device (no weights)
    llama = _meta(
        LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
        )
    )
    out = {}
    for name in ("llama3.1-8b-lora", "llama3.1-8b-qlora"):
        cfg = load_config(f"configs/{name}.yaml", check=False)
        s = resolve_settings(cfg, None, remove_unused_columns=False)
        out[name] = (cfg, s, estimate_memory(llama, cfg, s, meta=True))
    bf16, qlora = out["llama3.1-8b-lora"][2], out["llama3.1-8b-qlora"][2]
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # every projection of every layer
    assert bf16.parts["frozen weights"] == 2 * (linear + 2 * 128256 * 4096 + 65 * 4096)  # bf16, with norms
    # NF4: half a byte per weight plus the double-quantized block scales (~1/64 byte)
    assert linear / 2 < qlora.parts["quantized weights"] < linear * (0.5 + 1.1 / 64)
    # embeddings + head + norms in fp32 after prepare_model_for_kbit_training
    assert qlora.parts["unquantized weights (embeddings, lm_head, norms)"] == 4 * (2 * 128256 * 4096 + 65 * 4096)
    # paged 8-bit AdamW: ~2 bytes per LoRA parameter instead of AdamW's 8
    assert qlora.parts["optimizer state"] < 0.26 * bf16.parts["optimizer state"]
    assert qlora.total < 24 * 0.9 * GIB < bf16.total
    cfg, s, _ = out["llama3.1-8b-qlora"]
    (finding,) = memory_findings(cfg, s, cfg.doctor_checks, meta_model=llama)
    # the chunked loss holds one chunk of logits: the activations of 4 x 4096 tokens are now the largest part
    assert finding.severity == "info" and "largest: activations" in finding.what and "fits" in finding.what
    cfg, s, _ = out["llama3.1-8b-lora"]
    (finding,) = memory_findings(cfg, s, DoctorConfig(memory_budget_gib=24), meta_model=llama)
    assert finding.severity == "warning" and "exceeds" in finding.what and "load_in: 4bit" in finding.fix


@pytest.mark.parametrize("load_in", ["4bit", "8bit"])
def test_memory_estimate_of_a_meta_model_predicts_the_loaded_storage(base_dir, load_in):
    from transformers import AutoConfig

    from hf_stable.doctor.memory_estimate import estimate_memory
    from hf_stable.doctor.settings import resolve_settings

    cfg = load_config("configs/tiny-qlora.yaml", ["--model.quantization.load_in", load_in], check=False)
    s = resolve_settings(cfg, None, remove_unused_columns=False)
    real = estimate_memory(quantized_lora_llama(base_dir, load_in=load_in), cfg, s)
    meta = estimate_memory(_meta(AutoConfig.from_pretrained(base_dir)), cfg, s, meta=True)
    for part in ("quantized weights", "unquantized weights (embeddings, lm_head, norms)", "trainable weights"):
        assert meta.parts[part] == pytest.approx(real.parts[part], rel=0.02), part
    assert meta.parts["optimizer state"] == pytest.approx(real.parts["optimizer state"], rel=0.02)


def test_doctor_dry_run_on_the_tiny_qlora_recipe_restores_the_adapter(tmp_path):
    from hf_stable.doctor import run_doctor
    from hf_stable.modeling import apply_lora, load_model, resolve_base
    from tests.helpers import by_check, make_workdir, tiny_args

    cfg = load_config("configs/tiny-qlora.yaml", tiny_args(make_workdir(tmp_path)))
    base = resolve_base(cfg.model)
    torch.manual_seed(0)
    model = apply_lora(load_model(cfg, base), cfg.lora, quantization=cfg.model.quantization)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    report = run_doctor(cfg, model=model)
    assert report.exit_code == 0, [f.what for f in report.blocking_findings()]
    assert report.facts["dry_run"]["steps"] == cfg.doctor_checks.dry_run_steps
    (memory,) = by_check(report, "hazards.memory_estimate")
    assert "quantized weights" in memory.evidence and "base in 4bit nf4" in memory.evidence
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)  # 4-bit weights too


@pytest.mark.parametrize("upcast", [True, False])
def test_upcast_fp32_decides_the_dtype_of_the_unquantized_weights_and_the_estimate_follows(base_dir, upcast):
    from transformers import AutoConfig

    from hf_stable.config.model import LoraSection
    from hf_stable.config.quantization import QuantizationConfig
    from hf_stable.doctor.memory_estimate import estimate_memory
    from hf_stable.doctor.settings import resolve_settings
    from hf_stable.modeling import apply_lora
    from tests.qlora_helpers import TARGETS, load_quantized

    quant = QuantizationConfig(load_in="4bit", compute_dtype="bfloat16", upcast_fp32=upcast)
    model = load_quantized(base_dir, dtype=torch.bfloat16, compute_dtype="bfloat16")
    model = apply_lora(model, LoraSection(r=16, target_modules=TARGETS), quantization=quant)
    want = torch.float32 if upcast else torch.bfloat16
    head = model.get_output_embeddings().weight
    assert model.get_input_embeddings().weight.dtype == want and head.dtype == want
    argv = ["--model.dtype", "bfloat16", "--model.quantization.compute_dtype", "bfloat16", "--training.bf16", "true"]
    argv += ["--model.quantization.upcast_fp32", str(upcast).lower()]
    cfg = load_config("configs/tiny-qlora.yaml", argv, check=False)
    s = resolve_settings(cfg, None, remove_unused_columns=False)
    real = estimate_memory(model, cfg, s)
    meta = estimate_memory(_meta(AutoConfig.from_pretrained(base_dir)), cfg, s, meta=True)
    key = "unquantized weights (embeddings, lm_head, norms)"
    assert real.parts[key] == meta.parts[key] == (2 if not upcast else 4) * (2 * 128 * 64 + 5 * 64)
    assert ("lm_head autocast copy" in real.parts) == ("lm_head autocast copy" in meta.parts) == upcast
