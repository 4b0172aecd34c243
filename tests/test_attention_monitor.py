"""The sampled max-logit probe and `AttentionMonitorCallback`: exact values against a brute-force computation,
chunking, Trainer logs, alerts, and an inactive warning on a non-hf_stable model."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_stable.attention import AttentionSettings, get_probe, head_max_logits, register
from hf_stable.callbacks.builder import build_attention_callbacks
from hf_stable.callbacks.monitors.attention_monitor_callback import AttentionMonitorCallback
from hf_stable.config.attention import AttentionConfig
from hf_stable.core.events import read_events
from tests.helpers import make_tiny_model

CAPTURED: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}


def capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    CAPTURED[module.layer_idx] = (query.detach().clone(), key.detach().clone(), scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register(AttentionSettings())
    AttentionInterface.register("capture_qk", capture_attention)
    AttentionMaskInterface.register("capture_qk", sdpa_mask)
    yield
    get_probe().reset()


def batch_for(layout: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A batch plus, per token, whether it is real and which sample it belongs to (derived by hand)."""
    gen = torch.Generator().manual_seed(1)
    if layout == "packed":
        lengths = (6, 3, 5)
        ids = torch.randint(5, 300, (1, sum(lengths)), generator=gen)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
        return {"input_ids": ids, "position_ids": pos, "use_cache": False}, torch.ones_like(ids, dtype=torch.bool), seg
    lengths, T = (10, 7, 4), 10
    ids = torch.randint(5, 300, (3, T), generator=gen)
    real = torch.zeros(3, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        real[b, :n] = True
    if layout == "left":
        real = real.flip(-1)
    return {"input_ids": ids, "attention_mask": real.long()}, real, torch.zeros_like(ids)


def measure(model, batch) -> dict[int, list[float]]:
    probe = get_probe()
    probe.reset()
    probe.arm(step=-1)
    model.train()
    with torch.no_grad():
        model(**batch)
    probe.disarm()
    out = probe.read()
    probe.reset()
    return out


def brute_force_max(q, k, scaling, real, seg) -> list[float]:
    """Per-head max over (b, i, j) with j <= i, both tokens real, same sample: explicit loops over the pattern."""
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    logits = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * scaling
    B, H, T, _ = logits.shape
    best = [float("-inf")] * H
    for b in range(B):
        for i in range(T):
            for j in range(i + 1):
                if real[b, i] and real[b, j] and seg[b, i] == seg[b, j]:
                    for h in range(H):
                        best[h] = max(best[h], logits[b, h, i, j].item())
    return best


@pytest.mark.parametrize("layout", ["right", "left", "packed"])
def test_probe_equals_brute_force(arch, tokenizer, layout):
    batch, real, seg = batch_for(layout)
    ours = make_tiny_model(arch, tokenizer, attn_implementation="hf_stable")
    with torch.no_grad():  # spread the logits so that masked positions would change the maximum
        for layer in ours.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    spy = make_tiny_model(arch, tokenizer, attn_implementation="capture_qk")
    spy.load_state_dict(ours.state_dict())
    CAPTURED.clear()
    with torch.no_grad():
        spy(**batch)
    measured = measure(ours, batch)
    assert sorted(measured) == sorted(CAPTURED) == list(range(ours.config.num_hidden_layers))
    masking_mattered = False
    for layer, (q, k, scaling) in CAPTURED.items():
        want = brute_force_max(q, k, scaling, real, seg)
        assert measured[layer] == pytest.approx(want, abs=1e-5)
        everything = (q @ repeat_kv(k, q.shape[1] // k.shape[1]).transpose(-1, -2) * scaling).amax(dim=(0, 2, 3))
        masking_mattered |= any(e > w + 1e-4 for e, w in zip(everything.tolist(), want, strict=False))
    assert masking_mattered  # the pattern excluded some larger logit somewhere, so the check has teeth


def test_probe_chunking_and_eval_mode(tokenizer):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8)
    am = torch.arange(9)[None, :] < torch.tensor([[9], [5]])
    mask = sdpa_mask(batch_size=2, q_length=9, kv_length=9, attention_mask=am)
    whole = head_max_logits(q, k, mask, 0.3)
    chunked = head_max_logits(q, k, mask, 0.3, chunk_elements=7)  # one query row at a time
    assert torch.allclose(whole, chunked, rtol=0, atol=1e-6) and whole.shape == (4,)
    model = make_tiny_model("llama", tokenizer, attn_implementation="hf_stable").eval()
    probe = get_probe()
    probe.reset()
    probe.arm(step=5)
    model(input_ids=torch.randint(5, 300, (1, 8)))
    assert probe.read() == {}  # evaluation forwards never feed a sample
    probe.reset()


def test_trainer_logs_max_logit(tokenizer, tmp_path):
    from datasets import Dataset
    from transformers import Trainer

    model = make_tiny_model("qwen2", tokenizer, attn_implementation="hf_stable")
    ids = torch.randint(5, 300, (8, 16)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-3,
        disable_tqdm=True,
    )
    monitor = AttentionMonitorCallback(monitor_interval=2, logit_alert_threshold=-1e9)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[monitor])
    trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    for step in (1, 2):
        assert "attn/max_logit/layer_0" in logs[step] and "attn/max_logit/layer_1" in logs[step]
        assert logs[step]["attn/max_logit/max"] == max(
            logs[step]["attn/max_logit/layer_0"], logs[step]["attn/max_logit/layer_1"]
        )
    assert not any(k.startswith("attn/") for k in logs[3])  # step 3 is not sampled
    high = [e for e in read_events(tmp_path) if e["kind"] == "attn_logit_high"]
    assert sorted(e["group"] for e in high) == ["layer_0", "layer_1"]  # once per crossing, not per sample
    assert not get_probe().armed


def test_growth_alert_and_state_roundtrip():
    cb = AttentionMonitorCallback(
        monitor_interval=1,
        logit_alert_threshold=1e9,
        logit_growth_checks=4,
        logit_growth_ratio=1.5,
        logit_growth_min_share=0.0,
    )
    for step, value in enumerate([2.0, 2.1, 1.9, 2.0, 2.2, 2.5, 3.1], start=1):
        cb._observe(step, {0: value})
    growth = [e for e in cb.events if e["kind"] == "attn_logit_growth"]
    assert [e["step"] for e in growth] == [7]  # 1.9 < 2.0 < 2.2 < 2.5 < 3.1 after the dip; 3.1 / 2.0 >= 1.5
    cb2 = AttentionMonitorCallback()
    cb2.load_state_dict(cb.state_dict())
    assert cb2.state_dict() == cb.state_dict() and cb2.last_maxima == {0: 3.1}


def test_inactive_on_other_implementation(tokenizer, tmp_path):
    model = make_tiny_model("llama", tokenizer, attn_implementation="sdpa")
    cb = AttentionMonitorCallback(monitor_interval=1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control, model=model)
    cb.on_step_begin(args, state, control, model=model)
    assert not get_probe().armed
    assert [e["kind"] for e in cb.events] == ["attn_monitor_inactive"]


def test_build_attention_callbacks():
    from hf_stable.callbacks.guards.qk_clip_callback import QKClipCallback
    from hf_stable.config import AttentionConfig

    assert build_attention_callbacks(AttentionConfig(implementation="sdpa")) == []  # nothing to monitor
    cbs = build_attention_callbacks(AttentionConfig(implementation="hf_stable", qk_clip=True, qk_clip_tau=30.0))
    assert [type(c) for c in cbs] == [AttentionMonitorCallback, QKClipCallback]
    assert cbs[0].interval == 10 and cbs[1].tau == 30.0


# sampled max attention logits (every 10 steps): the healthy shape measured on `make demo` (a rise 20 -> 35 over
# five samples, then back to ~25) and the rescue benchmark's attn_logits case (540-1,020)
HEALTHY = [2.4, 4.1, 6.7, 9.0, 12.5, 17.9, 20.3, 24.0, 28.1, 31.2, 35.5, 30.2, 25.1, 26.0, 24.8]
FAULTY = [20.0, 35.0, 80.0, 160.0, 320.0, 540.0, 700.0, 1020.0]


def _alerts(values, **kw):
    cb = AttentionMonitorCallback(monitor_interval=1, **kw)
    for step, value in enumerate(values, start=1):
        cb._observe(step * 10, {0: value, 1: value / 2})
    return [e for e in cb.events if e["kind"].startswith("attn_logit")]


def test_the_level_based_rule_is_silent_on_a_healthy_rise_and_warns_near_saturation():
    assert _alerts(HEALTHY) == []
    alerts = _alerts(FAULTY)
    high = [e for e in alerts if e["kind"] == "attn_logit_high"]
    assert [(e["group"], e["step"]) for e in high] == [
        ("layer_0", 40),
        ("layer_1", 50),
    ]  # 160 > 100 at the 4th, 5th sample
    assert "layer 0 max attention logit 160 > the level 100 where softmax saturates" in high[0]["message"]
    growth = [e for e in alerts if e["kind"] == "attn_logit_growth"]
    assert growth and all(e["value"] >= 50 and e["threshold"] == 50 for e in growth)
    assert "past the level 50 (0.5 of 100, where softmax saturates)" in growth[0]["message"]


def test_growth_below_the_level_is_silent_and_fires_once_past_it():
    # the same steady x1.5-per-sample rise: silent while it stays under 50 (half the level), fires past it
    rise = [4.0, 6.0, 9.0, 13.5, 20.0, 30.0, 45.0]
    assert _alerts(rise) == []  # level 100: 45 < 50, nothing said
    fired = [e for e in _alerts([*rise, 67.5]) if e["kind"] == "attn_logit_growth"]
    assert [(e["group"], e["step"], e["value"]) for e in fired] == [("layer_0", 80, 67.5)]
    assert fired[0]["threshold"] == 50 and "past the level 50" in fired[0]["message"]


def test_a_softcap_lowers_the_level_to_the_cap():
    cb = AttentionMonitorCallback(AttentionConfig(softcap=30.0, backend="eager"), monitor_interval=1)
    assert cb.level == 30.0 and cb.growth_floor == 15.0
    cb._observe(10, {0: 31.0})
    assert [e["kind"] for e in cb.events] == ["attn_logit_high"]


def test_head_max_logits_is_the_max_of_the_scaled_masked_logits_bit_for_bit():
    torch.manual_seed(0)
    q, k = torch.randn(3, 8, 40, 16) * 3, torch.randn(3, 2, 40, 16) * 3  # GQA: 4 query heads per key head
    scaling = 16**-0.5
    logits = (q.reshape(3, 2, 4, 40, 16) @ k.unsqueeze(2).transpose(-1, -2)) * scaling
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    expected = logits.masked_fill(~causal, float("-inf")).amax(dim=(0, 3, 4)).reshape(8)
    for chunk in (1 << 26, 3 * 8 * 40 * 7):  # whole, and 7 query rows at a time
        assert torch.equal(head_max_logits(q, k, None, scaling, chunk_elements=chunk), expected)


def test_listed_pairs_give_the_chunked_paths_maximum_bit_for_bit():
    """A packed and padded batch's mask (transformers' `[B, 1, T, T]`) takes the listed-pairs path: its per-head
    maxima are the chunked path's floats; a mask shared by every layer is listed once and not kept alive."""
    import gc
    import weakref

    from hf_stable.attention import probe as probe_module

    torch.manual_seed(1)
    batch, heads, kv_heads, t, d = 3, 8, 2, 37, 16
    q, k = torch.randn(batch, heads, t, d) * 3, torch.randn(batch, kv_heads, t, d) * 3
    seg = torch.tensor([[0] * 12 + [1] * 25, [0] * 30 + [1] * 7, [0] * 20 + [-1] * 17])  # -1: padding
    pos = torch.arange(t)
    mask = (seg[:, :, None] == seg[:, None, :]) & (pos[None, :] <= pos[:, None]) & (seg[:, None, :] >= 0)
    mask = mask[:, None]  # [B, 1, T, T]; the padding rows allow nothing, not even themselves
    scaling = d**-0.5
    fast = head_max_logits(q, k, mask, scaling)
    chunked = head_max_logits(q, k, mask, scaling, chunk_elements=batch * heads * t * 5)  # 5 query rows at a time
    assert torch.equal(fast, chunked) and fast.shape == (heads,)
    logits = (q.reshape(batch, kv_heads, 4, t, d) @ k.unsqueeze(2).transpose(-1, -2)).reshape(batch, heads, t, t)
    assert torch.equal(fast, logits.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)) * scaling)
    everything = logits.amax(dim=(0, 2, 3)) * scaling
    assert (everything > fast).any()  # the pattern excluded a larger logit: the check has teeth
    listed = probe_module._ALLOWED.get(mask, batch, heads, t, t)
    assert listed is probe_module._ALLOWED.get(mask, batch, heads, t, t)  # a second layer reuses the list
    assert probe_module._ALLOWED.get(mask.to("meta"), batch, heads, t, t) is None  # off CPU: no listing (a sync)
    assert listed.shape == (int(mask.sum()), heads)  # every real query may attend to itself: no row left out
    held = weakref.ref(mask)
    del mask
    gc.collect()
    assert held() is None  # the cache holds the mask weakly
