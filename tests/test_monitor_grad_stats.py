"""GradStats against a brute-force per-parameter reference, its one-transfer promise and its per-step cache."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hf_stable.core.grad_stats import GradStats
from hf_stable.optim.roles import group_parameters
from tests.helpers import make_tiny_model


class _CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


def _reference(model):
    """The slow, obviously-correct version: one loop, one .item() per statistic per tensor."""
    groups = group_parameters(model)
    norms, bad, best = {}, {}, (-1.0, None, None)
    total = 0.0
    for group, members in groups.items():
        sq, nbad = 0.0, 0
        for name, p in members:
            if p.grad is None:
                continue
            n = p.grad.double().norm().item()
            sq += n * n
            if not torch.isfinite(p.grad).all().item():
                nbad += 1
                continue
            m = p.grad.abs().max().item()
            if m > best[0]:
                best = (m, group, name)
        norms[group], bad[group] = math.sqrt(sq), nbad
        total += sq
    return math.sqrt(total), norms, bad, best


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_matches_bruteforce_reference(arch, tokenizer):
    model = make_tiny_model(arch, tokenizer)
    _backward(model)
    report = GradStats(model).compute(model, step=0, max_abs=True)
    total, norms, bad, (max_abs, max_group, max_param) = _reference(model)
    assert report.available and report.n_tensors == sum(1 for p in model.parameters() if p.grad is not None)
    assert report.global_norm == pytest.approx(total, rel=1e-5)
    assert set(report.group_norms) == set(norms)
    for group, value in norms.items():
        assert report.group_norms[group] == pytest.approx(value, rel=1e-5, abs=1e-12), group
    assert report.nonfinite == bad and report.nonfinite_total == 0
    assert report.max_abs == pytest.approx(max_abs, rel=1e-6)
    assert (report.max_abs_group, report.max_abs_param) == (max_group, max_param)
    # the Trainer's own number for the same gradients
    ref = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert report.global_norm == pytest.approx(ref.item(), rel=1e-5)


def test_nonfinite_counts_and_max_location_skip_bad_tensors(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    _backward(model)
    layers = model.model.layers
    layers[1].mlp.up_proj.weight.grad[0, 0] = float("nan")
    layers[0].self_attn.k_proj.weight.grad[1, 1] = float("inf")
    layers[0].self_attn.o_proj.weight.grad[2, 3] = 5e3  # the largest finite element
    report = GradStats(model).compute(model, step=0, max_abs=True)
    _, _, bad, _ = _reference(model)
    assert report.nonfinite == bad
    assert report.nonfinite["layer_0"] == 1 and report.nonfinite["layer_1"] == 1
    assert math.isnan(report.group_norms["layer_1"]) and math.isinf(report.group_norms["layer_0"])
    assert not math.isfinite(report.global_norm)
    assert report.max_abs == pytest.approx(5e3)
    assert report.max_abs_param == "model.layers.0.self_attn.o_proj.weight" and report.max_abs_group == "layer_0"
    metrics = report.metrics()
    assert metrics["grad/nonfinite/layer_0"] == 1.0 and metrics["grad/nonfinite_total"] == 2.0
    assert "grad/nonfinite/embeddings" not in metrics  # zero counts are not logged per group


def test_one_host_transfer_and_per_step_cache(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    _backward(model)
    stats = GradStats.shared(model)
    assert GradStats.shared(model) is stats
    stats.add_source("test", lambda: {"x": torch.tensor(2.5)})
    with _CountCalls() as counter:
        report = stats.compute(model, step=7)
    transfers = {k: v for k, v in counter.calls.items() if k in ("tolist", "item", "cpu", "__float__", "numpy")}
    assert transfers == {"tolist": 1}
    assert report.extras == {"x": 2.5}
    # max |g| is a second pass, taken only on request; the per-tensor L2 maximum bounds it meanwhile
    assert not report.has_max_abs and "grad/max_abs" not in report.metrics()
    with _CountCalls() as counter:
        assert stats.compute(model, step=7, max_abs=True) is report
    assert counter.calls.get("tolist") == 1 and report.has_max_abs
    per_tensor = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
    assert report.max_param_norm == pytest.approx(max(per_tensor.values()), rel=1e-5)
    assert report.max_norm_param == max(per_tensor, key=per_tensor.get)
    assert 0 < report.max_abs <= report.max_param_norm and report.metrics()["grad/max_abs"] == report.max_abs
    # a guard clipping in place (inside `edited`) after the first computation does not change what later readers get
    before = report.global_norm
    with stats.edited(7, torch.tensor(0.01)):
        torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], 0.01)
    assert stats.compute(model, step=7) is report and stats.compute(model, step=7).global_norm == before
    dev = stats.device_stats(model, step=7)
    assert dev.group_norms.shape == (len(dev.groups),) and dev.global_norm.item() == pytest.approx(before, rel=1e-6)
    # the next step (new gradients) is computed afresh
    _backward(model, seed=1)
    fresh = stats.compute(model, step=8)
    assert fresh is not report and fresh.global_norm != pytest.approx(before * 0.01, rel=1e-3)


def test_no_gradients_is_unavailable_never_zero(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    report = GradStats(model).compute(model, step=0)
    assert not report.available and "no parameter" in report.reason
    assert report.metrics() == {} and math.isnan(report.global_norm)


def test_lora_groups_are_reported(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_tiny_model("qwen2", tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    _backward(model)
    report = GradStats(model).compute(model, step=0)
    assert set(report.group_norms) == {f"layer_{i}.lora_{s}" for i in range(2) for s in "AB"}
    _, norms, _, _ = _reference(model)
    for group, value in norms.items():
        assert report.group_norms[group] == pytest.approx(value, rel=1e-5, abs=1e-12)
    # LoRA B starts at zero, so the gradient of A is zero at step one while B gets one
    assert report.group_norms["layer_0.lora_B"] > 0 and report.group_norms["layer_0.lora_A"] == 0.0


def test_a_skip_after_the_first_reader_keeps_the_step_report(tokenizer):
    """A guard that skips the step (p.grad = None) after reading must not change or break later readers."""
    model = make_tiny_model("llama", tokenizer)
    _backward(model)
    stats = GradStats.shared(model)
    first = stats.compute(model, step=3)
    for p in model.parameters():
        p.grad = None
    later = stats.compute(model, step=3, max_abs=True)
    assert later is first and later.available and not later.has_max_abs
    assert stats.device_stats(model, step=3).global_norm.item() == pytest.approx(first.global_norm)
    assert not stats.compute(model, step=4).available  # the next step has no gradients at all


def test_a_gradient_edited_after_the_statistics_is_seen_by_the_next_reader(tokenizer):
    """What the guards judge must be what the optimizer applies: an edit by someone else (a user's callback, a
    fault) after the first computation invalidates the cache; the step's extras are not summed over ranks again."""
    model = make_tiny_model("llama", tokenizer)
    _backward(model)
    stats = GradStats.shared(model)
    calls = []
    stats.add_source("test", lambda: calls.append(1) or {"x": torch.tensor(2.5)})
    stats.begin_step()
    first = stats.compute(model, step=5)
    # our own clip by 0.1 (recorded), then a foreign x1e4 spike of every gradient: the next reader sees the spike,
    # on the pre-clip scale of the first report
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    with stats.edited(5, torch.tensor(0.1)):
        torch._foreach_mul_(grads, 0.1)
    assert stats.compute(model, step=5) is first
    torch._foreach_mul_(grads, 1e4)
    spiked = stats.compute(model, step=5)
    assert spiked is not first and spiked.global_norm == pytest.approx(first.global_norm * 1e4, rel=1e-4)
    assert spiked.extras == {"x": 2.5} and len(calls) == 1  # the extras were reused, not re-reduced
    # a NaN written through a view of one gradient, and a gradient replaced by a new tensor
    model.model.layers[1].mlp.up_proj.weight.grad.view(-1)[3] = float("nan")
    assert stats.compute(model, step=5).nonfinite_total == 1
    model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, float("inf"))
    assert stats.compute(model, step=5).nonfinite == {**{g: 0 for g in first.nonfinite}, "layer_1": 1, "lm_head": 1}
    # unchanged gradients keep the cached report; a skip (every gradient dropped) keeps it too
    last = stats.compute(model, step=5)
    assert stats.compute(model, step=5) is last
    model.zero_grad(set_to_none=True)
    assert stats.compute(model, step=5) is last
    # a new step transfers its extras anew
    stats.begin_step()
    _backward(model, seed=2)
    assert stats.compute(model, step=6).available and len(calls) == 2


def test_the_per_model_table_remembers_its_last_lookup_weakly():
    """`GradStats.shared` answers a repeated model from its last lookup, a new entry replaces it, and neither the
    model nor its statistics outlive their last outside reference."""
    import gc
    import weakref

    from hf_stable.core.model_table import ModelTable

    table = ModelTable()
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    first = GradStats(a)
    table[a] = first
    assert table.get(a) is first and table.get(a) is first and table.get(b) is None
    second = GradStats(a)
    table[a] = second  # replacing the entry forgets the remembered one
    assert table.get(a) is second
    held_model, held_stats = weakref.ref(a), weakref.ref(second)
    del a, first, second
    gc.collect()
    assert held_model() is None and held_stats() is None and len(table) == 0
    shared = GradStats.shared(b)
    assert GradStats.shared(b) is shared


def test_a_check_holds_for_the_span_of_our_callbacks_and_ends_with_it(tokenizer):
    """Inside a span of hf_stable's own callbacks (`open_span`, opened by StableTrainer's dispatch) the gradients,
    once found unchanged, are not read again; ending the span (another callback runs, a skip drops gradients) makes
    the next reader check them, so a foreign edit is seen."""
    from hf_stable.core.grad_span import close_span, open_span

    model = make_tiny_model("llama", tokenizer)
    _backward(model)
    stats = GradStats.shared(model)
    stats.begin_step()
    try:
        open_span()
        first = stats.compute(model, step=7)
        grad = model.lm_head.weight.grad
        grad.view(-1)[0] = float("nan")  # not something our callbacks do inside a span
        assert stats.compute(model, step=7) is first  # trusted: no read of the gradients
        close_span()  # e.g. a user's callback runs next
        open_span()
        assert stats.compute(model, step=7).nonfinite["lm_head"] == 1
    finally:
        close_span()
    assert stats.compute(model, step=7).nonfinite["lm_head"] == 1
