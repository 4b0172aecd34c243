"""The `hf_stable` attention implementation: equality with stock SDPA, soft-cap, the flash path (with a
fake `flash_attn` module that checks what it is given), sliding windows, gradcheck, registration."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_stable.attention import (
    AttentionSettings,
    backend_usage,
    get_probe,
    hf_stable_attention_forward,
    is_registered,
    register,
    reset_backend_usage,
    use_settings,
)
from hf_stable.attention.kernels import explicit_forward
from hf_stable.errors import ConfigError, HfStableError, MissingDependencyError
from tests.helpers import make_tiny_model

LENGTHS = (12, 9, 6)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register(AttentionSettings())
    yield


def padded_batch(side: str, vocab: int = 300, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    ids = torch.randint(5, vocab, (len(LENGTHS), T), generator=gen)
    am = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        if side == "right":
            am[b, :n] = 1
        else:
            am[b, T - n :] = 1
    labels = ids.masked_fill(am == 0, -100)
    return {"input_ids": ids, "attention_mask": am, "labels": labels}


def packed_batch(vocab: int = 300, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = (5, 4, 3)
    ids = torch.randint(5, vocab, (1, sum(lengths)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100  # a flattening collator masks each sample's first label
    return {
        "input_ids": ids,
        "position_ids": pos,
        "labels": labels,
        "use_cache": False,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": 5,
        "max_length_k": 5,
    }


def run(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def valid_rows(batch) -> torch.Tensor:
    am = batch.get("attention_mask")
    return am.bool() if am is not None else torch.ones(batch["input_ids"].shape, dtype=torch.bool)


def max_diff(a_logits, a_grads, b_logits, b_grads, rows):
    d = (a_logits[rows] - b_logits[rows]).abs().max().item()
    g = max((a_grads[n] - b_grads[n]).abs().max().item() for n in a_grads)
    assert a_grads.keys() == b_grads.keys()
    return d, g


@pytest.mark.parametrize("layout", ["right", "left", "packed"])
def test_features_off_equal_stock_sdpa(arch, tokenizer, layout):
    batch = packed_batch() if layout == "packed" else padded_batch(layout)
    ref = make_tiny_model(arch, tokenizer, attn_implementation="sdpa")
    ours = make_tiny_model(arch, tokenizer, attn_implementation="hf_stable")
    ref_l, ref_g = run(ref, batch)
    with use_settings(AttentionSettings()):
        our_l, our_g = run(ours, batch)
    d, g = max_diff(ref_l, ref_g, our_l, our_g, valid_rows(batch))
    assert d <= 1e-6 and g <= 1e-6, (d, g)
    # The explicit fp32-softmax path is a different computation: equal within float32 rounding on real tokens.
    with use_settings(AttentionSettings(backend="eager")):
        exp_l, exp_g = run(ours, batch)
    d, g = max_diff(ref_l, ref_g, exp_l, exp_g, valid_rows(batch))
    assert d <= 1e-6 and g <= 1e-6, (d, g)


def test_packed_equals_samples_run_alone(arch, tokenizer):
    batch = packed_batch()
    model = make_tiny_model(arch, tokenizer, attn_implementation="hf_stable")
    packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    start = 0
    for n in (5, 4, 3):
        alone = model(input_ids=batch["input_ids"][:, start : start + n], use_cache=False).logits[0]
        assert (alone - packed[start : start + n]).abs().max().item() < 1e-5
        start += n


def test_flattening_collator_batch(tokenizer):
    """The kwargs transformers' own flattening collator emits reach the attention function and keep samples apart."""
    from transformers import DataCollatorWithFlattening

    rows = [{"input_ids": list(range(10, 10 + n))} for n in (7, 3, 5)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(rows)
    assert {"position_ids", "cu_seq_lens_q", "max_length_q"} <= set(batch)
    model = make_tiny_model("qwen3", tokenizer, attn_implementation="hf_stable")
    packed = model(**batch, use_cache=False).logits[0]
    start = 0
    for row in rows:
        n = len(row["input_ids"])
        alone = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
        assert (alone - packed[start : start + n]).abs().max().item() < 1e-5
        start += n


def test_packed_without_position_ids_keeps_samples_apart():
    """Only cu_seq_lens marks the boundaries: the function must not let samples attend across them."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False, layer_idx=0)
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    seg = torch.tensor([0] * 5 + [1] * 4 + [2] * 3)
    block = (seg[:, None] == seg[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    ref, _ = sdpa_attention_forward(module, q, k, v, block[None, None], scaling=0.3)
    for backend in ("auto", "eager"):
        with use_settings(AttentionSettings(backend=backend)):
            out, _ = hf_stable_attention_forward(
                module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu
            )
        assert (out - ref).abs().max().item() < 1e-5, backend


def reference_softcap_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Textbook eager attention with soft-capping, written independently of hf_stable."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    logits = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    logits = 50.0 * torch.tanh(logits / 50.0)
    if attention_mask is None:
        T = query.shape[2]
        attention_mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    logits = logits.masked_fill(~attention_mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def test_softcap_equals_reference_eager(arch, tokenizer):
    AttentionInterface.register("ref_softcap", reference_softcap_attention)
    AttentionMaskInterface.register("ref_softcap", sdpa_mask)
    batch = padded_batch("right")
    ours = make_tiny_model(arch, tokenizer, attn_implementation="hf_stable")
    with torch.no_grad():  # large q/k so that many logits are beyond the cap
        for layer in ours.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "q_norm"):
                attn.q_norm.weight.mul_(40.0)
                attn.k_norm.weight.mul_(40.0)
            else:
                attn.q_proj.weight.mul_(40.0)
                attn.k_proj.weight.mul_(40.0)
    ref = make_tiny_model(arch, tokenizer, attn_implementation="ref_softcap")
    ref.load_state_dict(ours.state_dict())
    rows = valid_rows(batch)
    ref_l, ref_g = run(ref, batch)
    with use_settings(AttentionSettings(softcap=50.0)):
        reset_backend_usage()
        cap_l, cap_g = run(ours, batch)
        assert backend_usage().get("explicit", 0) > 0 and "sdpa" not in backend_usage()
    probe = get_probe()
    probe.arm(step=-1)
    ours.train()
    plain_l, _ = run(ours, batch)
    raw_max = max(probe.layer_maxima().values())
    probe.reset()
    d, g = max_diff(ref_l, ref_g, cap_l, cap_g, rows)
    assert d < 1e-4 and g < 1e-4, (d, g)
    # the cap really acted: raw logits went far past it, and the model output changed
    assert raw_max > 75.0
    assert (plain_l[rows] - cap_l[rows]).abs().max().item() > 1e-3


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = sdpa_mask(
        batch_size=2, q_length=5, kv_length=5, attention_mask=torch.tensor([[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]).bool()
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: explicit_forward(q, k, v, mask, scaling=0.7, softcap=1.5)[0], (q, k, v)
    )
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False, layer_idx=0)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    for backend in ("eager", "auto"):
        with use_settings(AttentionSettings(backend=backend)):
            assert torch.autograd.gradcheck(
                lambda q, k, v: hf_stable_attention_forward(module, q, k, v, None, scaling=0.7, cu_seq_lens_q=cu)[0],
                (q[:1], k[:1], v[:1]),
            )


# --- flash path, exercised with a fake flash_attn that checks its inputs ---------------------------------------
def fake_flash_module(calls: list) -> types.ModuleType:
    def attend(q, k, v, scale, causal, window, softcap):  # one sequence: [T, H, D]
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype == v.dtype
        assert q.shape[1] % k.shape[1] == 0
        rep = q.shape[1] // k.shape[1]
        kf = k.float().repeat_interleave(rep, dim=1)
        vf = v.float().repeat_interleave(rep, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        Tq, Tk = q.shape[0], k.shape[0]
        qi = torch.arange(Tq)[:, None] + (Tk - Tq)
        ki = torch.arange(Tk)[None, :]
        allowed = ki <= qi if causal else torch.ones(Tq, Tk, dtype=torch.bool)
        if window[0] >= 0:
            allowed &= ki >= qi - window[0]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)

    def flash_attn_func(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        assert q.dim() == 4 and k.dim() == 4 and q.shape[0] == k.shape[0]
        calls.append(
            {
                "fn": "dense",
                "shape": tuple(q.shape),
                "causal": causal,
                "dtype": q.dtype,
                "scale": softmax_scale,
                "window": window_size,
                "softcap": softcap,
            }
        )
        return torch.stack(
            [attend(q[b], k[b], v[b], softmax_scale, causal, window_size, softcap) for b in range(q.shape[0])]
        )

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        assert q.dim() == 3 and k.dim() == 3
        for cu, total, mx in ((cu_seqlens_q, q.shape[0], max_seqlen_q), (cu_seqlens_k, k.shape[0], max_seqlen_k)):
            assert cu.dtype == torch.int32 and cu[0].item() == 0 and cu[-1].item() == total
            assert bool((cu[1:] > cu[:-1]).all()) and isinstance(mx, int) and mx == int((cu[1:] - cu[:-1]).max())
        calls.append(
            {
                "fn": "varlen",
                "cu": cu_seqlens_q.tolist(),
                "causal": causal,
                "dtype": q.dtype,
                "scale": softmax_scale,
                "window": window_size,
                "softcap": softcap,
            }
        )
        cu = cu_seqlens_q.tolist()
        return torch.cat(
            [
                attend(q[a:b], k[a:b], v[a:b], softmax_scale, causal, window_size, softcap)
                for a, b in itertools.pairwise(cu)
            ]
        )

    mod = types.ModuleType("flash_attn")
    mod.flash_attn_func = flash_attn_func
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


@pytest.fixture
def fake_flash(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_module(calls))
    return calls


def test_flash_path_function_level(fake_flash):
    torch.manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False, layer_idx=0)
    q, k, v = (torch.randn(3, h, 12, 8) for h in (4, 2, 2))
    am = padded_batch("left")["attention_mask"].bool()
    mask = sdpa_mask(batch_size=3, q_length=12, kv_length=12, attention_mask=am)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.35)
    with use_settings(AttentionSettings(backend="flash")):
        out, _ = hf_stable_attention_forward(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scaling=0.35)
        dense, _ = hf_stable_attention_forward(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=0.35)
    assert fake_flash[0] == {
        "fn": "varlen",
        "cu": [0, 12, 21, 27],
        "causal": True,
        "dtype": torch.bfloat16,
        "scale": 0.35,
        "window": (-1, -1),
        "softcap": 0.0,
    }
    assert fake_flash[1]["fn"] == "dense" and fake_flash[1]["shape"] == (3, 12, 4, 8)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 12, 4, 8)
    assert (out.float()[am] - ref[am]).abs().max().item() < 3e-2
    assert out.float()[~am].abs().max().item() == 0.0  # padding rows stay zero
    ref_dense, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.35)
    assert (dense.float() - ref_dense).abs().max().item() < 3e-2
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)  # packed, without max_length_* kwargs
    with use_settings(AttentionSettings(backend="flash")):
        one = [t[:1].bfloat16() for t in (q, k, v)]
        hf_stable_attention_forward(module, *one, None, scaling=0.35, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert fake_flash[-1]["fn"] == "varlen" and fake_flash[-1]["cu"] == [0, 5, 12]
    with use_settings(AttentionSettings(backend="flash", softcap=50.0)):
        hf_stable_attention_forward(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=0.35)
    assert fake_flash[-1]["softcap"] == 50.0


@pytest.mark.parametrize("layout", ["right", "packed"])
def test_flash_path_in_model(fake_flash, tokenizer, layout):
    batch = packed_batch() if layout == "packed" else padded_batch(layout)
    ours = make_tiny_model("qwen2", tokenizer, attn_implementation="hf_stable").to(torch.bfloat16)
    ref = make_tiny_model("qwen2", tokenizer, attn_implementation="sdpa")
    with use_settings(AttentionSettings(backend="flash")):
        reset_backend_usage()
        logits = ours(**batch).logits.float()
        ours(**batch).loss.backward()  # gradients flow through the unpad / varlen / scatter path
        assert backend_usage() == {"flash": 4}  # 2 layers, forward twice
    want = [0, 5, 9, 12] if layout == "packed" else [0, 12, 21, 27]
    assert {c["fn"] for c in fake_flash} == {"varlen"} and all(c["cu"] == want for c in fake_flash)
    assert all(c["causal"] and c["dtype"] == torch.bfloat16 for c in fake_flash)
    assert ours.model.layers[0].self_attn.q_proj.weight.grad is not None
    rows = valid_rows(batch)
    ref_logits = ref(**batch).logits
    assert (logits[rows] - ref_logits[rows]).abs().max().item() < 0.1  # bf16 model vs fp32 model


def test_flash_forced_errors(monkeypatch):
    module = types.SimpleNamespace(num_key_value_groups=1, is_causal=True, training=False, layer_idx=0)
    q = torch.randn(1, 2, 4, 8)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    with use_settings(AttentionSettings(backend="flash")), pytest.raises(MissingDependencyError, match="hf-stable"):
        hf_stable_attention_forward(module, q, q, q, None, scaling=0.3)
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_module([]))
    with use_settings(AttentionSettings(backend="flash")), pytest.raises(HfStableError, match="bfloat16"):
        hf_stable_attention_forward(module, q, q, q, None, scaling=0.3)


def test_sliding_window_honoured(fake_flash, tokenizer):
    from transformers import AutoModelForCausalLM

    base = make_tiny_model("qwen2", tokenizer)
    cfg = base.config
    cfg.use_sliding_window, cfg.sliding_window, cfg.max_window_layers = True, 4, 0
    cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    batch = padded_batch("right")
    rows = valid_rows(batch)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(cfg, attn_implementation="hf_stable")
    ours.load_state_dict(ref.state_dict())
    full = AutoModelForCausalLM.from_config(
        base.config.__class__(**{**cfg.to_dict(), "use_sliding_window": False, "layer_types": None}),
        attn_implementation="sdpa",
    )
    full.load_state_dict(ref.state_dict())
    ref_l = ref(**batch).logits
    assert (ref_l[rows] - full(**batch).logits[rows]).abs().max().item() > 1e-3  # the window matters here
    assert (ours(**batch).logits - ref_l).abs().max().item() <= 1e-6
    with use_settings(AttentionSettings(backend="eager")):
        assert (ours(**batch).logits[rows] - ref_l[rows]).abs().max().item() < 2e-5
    with use_settings(AttentionSettings(backend="flash")):
        flash_l = ours.to(torch.bfloat16)(**batch).logits.float()
    assert all(c["window"] == (3, 0) for c in fake_flash) and fake_flash
    assert (flash_l[rows] - ref_l[rows]).abs().max().item() < 0.1


def test_register_twice_is_harmless(tokenizer):
    register()
    register(AttentionSettings())
    assert is_registered()
    assert AttentionInterface()["hf_stable"] is hf_stable_attention_forward
    assert AttentionMaskInterface()["hf_stable"] is sdpa_mask
    model = make_tiny_model("llama", tokenizer, attn_implementation="hf_stable")
    batch = padded_batch("right")
    ref = make_tiny_model("llama", tokenizer, attn_implementation="sdpa")
    assert torch.equal(model(**batch).logits, ref(**batch).logits)


def test_settings_and_config_validation():
    from hf_stable.config import AttentionConfig
    from hf_stable.config.loader import build_section

    with pytest.raises(ConfigError, match="SDPA cannot soft-cap"):
        AttentionSettings(backend="sdpa", softcap=50.0)
    with pytest.raises(ConfigError, match="softcap"):
        AttentionSettings(softcap=-1.0)
    problems: list[str] = []
    build_section(
        AttentionConfig,
        {"implementation": "sdpa", "softcap": 50.0, "qk_clip_alpha": 2.0, "monitor_interval": -1},
        "attention",
        problems,
    )
    text = "\n".join(problems)
    assert "attention.implementation" in text and "qk_clip_alpha" in text and "monitor_interval" in text
    problems = []
    cfg = build_section(
        AttentionConfig, {"implementation": "hf_stable", "softcap": 50, "qk_clip": True}, "attention", problems
    )
    assert problems == [] and cfg.softcap == 50.0
    assert AttentionSettings.from_config(cfg).softcap == 50.0
