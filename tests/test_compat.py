"""Each entry point of `hf_stable.compat` against the installed torch / transformers: a version that renames or
changes one of the private APIs behind it fails here, by name."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import transformers

from hf_stable import compat


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, generator=g), torch.randn(3, 4, generator=g), torch.zeros(0)]


def test_foreach_norm_matches_per_tensor_norms_in_the_requested_dtype():
    for ord in (2.0, math.inf):
        xs = _tensors() if ord == 2.0 else _tensors()[:2]  # torch refuses the inf-norm of an empty tensor
        got = compat.foreach_norm(xs, ord)
        want = [torch.linalg.vector_norm(x, ord) for x in xs]
        assert isinstance(got, list) and len(got) == len(xs)
        torch.testing.assert_close(torch.stack(got), torch.stack(want))
    half = [x.to(torch.bfloat16) for x in _tensors()]
    assert all(n.dtype == torch.float32 for n in compat.foreach_norm(half, 2.0))


def test_foreach_mul_copy_and_sub():
    xs = _tensors()
    before = [x.clone() for x in xs]
    copies = compat.foreach_copy(xs)
    assert all(c.data_ptr() != x.data_ptr() for c, x in zip(copies, xs, strict=True) if x.numel())
    compat.foreach_mul_(xs, 3.0)
    compat.foreach_mul_(xs, torch.tensor(0.5))
    for x, b, c in zip(xs, before, copies, strict=True):
        torch.testing.assert_close(x, b * 1.5)
        torch.testing.assert_close(c, b)  # the copy did not follow the in-place change
    for d, x, b in zip(compat.foreach_sub(xs, copies), xs, before, strict=True):
        torch.testing.assert_close(d, x - b)
    factors = [float(i + 2) for i in range(len(xs))]  # one factor per tensor, in one call
    compat.foreach_mul_(xs, factors)
    for x, b, f in zip(xs, before, factors, strict=True):
        torch.testing.assert_close(x, b * 1.5 * f)


def test_tensor_version_counts_in_place_changes():
    x = torch.zeros(3)
    v = compat.tensor_version(x)
    x.add_(1)
    assert compat.tensor_version(x) == v + 1
    x.mul_(2)
    assert compat.tensor_version(x) == v + 2
    y = torch.ones(2)
    assert compat.tensor_versions([x, y]) == [v + 2, compat.tensor_version(y)]
    assert compat.tensor_versions([x, None, y]) == [v + 2, -1, compat.tensor_version(y)]


def test_optimizer_hook_dicts_are_the_ones_optimizer_init_makes():
    p = torch.nn.Parameter(torch.ones(2))
    real = torch.optim.SGD([p], lr=0.1)
    made = {k for k, v in vars(real).items() if k.startswith("_optimizer_") and k.endswith("_hooks")}
    assert made == set(compat.OPTIMIZER_HOOK_DICTS)

    class Bare(torch.optim.Optimizer):  # skips Optimizer.__init__, as PhasedOptimizer does
        def __init__(self):
            compat.init_optimizer_hooks(self)
            self.param_groups, self.state, self.defaults = real.param_groups, real.state, real.defaults

    bare = Bare()
    seen = []
    bare.register_step_pre_hook(lambda opt, args, kwargs: seen.append("pre"))
    bare.register_state_dict_pre_hook(lambda opt: seen.append("sd"))
    bare.register_load_state_dict_post_hook(lambda opt: seen.append("load"))
    bare.state_dict()
    assert "sd" in seen and all(len(getattr(bare, k)) <= 1 for k in compat.OPTIMIZER_HOOK_DICTS)


def _scaled_step(bad: bool):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale((w * torch.tensor([3.0, 5.0])).sum()).backward()
    if bad:
        w.grad[0] = float("inf")
    return w, opt, scaler


def test_scaler_unscale_once_unscales_once_and_reports_overflow():
    w, opt, scaler = _scaled_step(bad=False)
    torch.testing.assert_close(w.grad, torch.tensor([12.0, 20.0]))
    assert compat.scaler_unscale_once(scaler, opt) is False
    torch.testing.assert_close(w.grad, torch.tensor([3.0, 5.0]))
    assert compat.scaler_unscale_once(scaler, opt) is False  # no second unscale (GradScaler would raise)
    torch.testing.assert_close(w.grad, torch.tensor([3.0, 5.0]))
    scaler.step(opt)  # the scaler accepts the step as unscaled
    torch.testing.assert_close(w.detach(), torch.tensor([0.7, 1.5]))
    _, opt, scaler = _scaled_step(bad=True)
    assert compat.scaler_unscale_once(scaler, opt) is True


def test_fused_optimizer_device_types_name_where_fused_adamw_runs():
    kinds = compat.fused_optimizer_device_types()
    assert "cuda" in kinds
    assert ("cpu" in kinds) == (tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 4))
    if "cpu" in kinds:  # what the list promises: a fused AdamW step on this device type, same as the for-loop one
        ws = [torch.nn.Parameter(torch.tensor([1.0, -2.0])) for _ in range(2)]
        for w, fused in zip(ws, (True, False), strict=True):
            w.grad = torch.tensor([0.5, 0.25])
            kernel = {"fused": True} if fused else {"foreach": False}
            torch.optim.AdamW([w], lr=0.1, weight_decay=0.01, **kernel).step()
        torch.testing.assert_close(ws[0].detach(), ws[1].detach())
        assert not torch.equal(ws[0].detach(), torch.tensor([1.0, -2.0]))


def _tiny_config():
    return transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def test_attn_implementation_reads_model_and_config():
    config = _tiny_config()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert compat.attn_implementation(model) == "eager" == compat.attn_implementation(model.config)
    model.set_attn_implementation("sdpa")
    assert compat.attn_implementation(model) == "sdpa"
    assert compat.attn_implementation(object()) is None


@pytest.mark.parametrize("name", sorted(compat.TRAINER_METHODS))
def test_private_trainer_methods_exist_with_the_signature_we_use(name):
    method = getattr(transformers.Trainer, name)
    params = inspect.signature(method).parameters
    assert tuple(params) == compat.TRAINER_METHODS[name]
    assert not any(p.default is inspect.Parameter.empty for n, p in params.items() if n == "grad_norm")


@pytest.mark.parametrize("name", sorted(compat.TRL_DPO_METHODS))
def test_private_dpo_trainer_methods_exist_with_the_signature_we_override(name):
    trl = pytest.importorskip("trl")
    from hf_stable.stages.dpo import _trainer_class

    assert tuple(inspect.signature(getattr(trl.DPOTrainer, name)).parameters) == compat.TRL_DPO_METHODS[name]
    assert tuple(inspect.signature(getattr(_trainer_class(), name)).parameters) == compat.TRL_DPO_METHODS[name]


def test_has_mixed_mesh_grads_on_a_plain_model(tmp_path):
    model = transformers.LlamaForCausalLM(_tiny_config())
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=model, args=args)
    ids = torch.arange(8)[None] % 32
    model(input_ids=ids, labels=ids).loss.backward()
    assert compat.has_mixed_mesh_grads(trainer, model) is False
    # and the StableTrainer overrides still match the Trainer's methods they replace
    from hf_stable.trainer import StableTrainer

    for name in ("_clip_grad_norm", "_get_grad_norm", "_get_train_sampler", "_init_training_state"):
        assert tuple(inspect.signature(getattr(StableTrainer, name)).parameters) == compat.TRAINER_METHODS[name]


def test_dynamo_compile_counts_count_compiles_recompiles_and_breaks():
    def f(x):
        y = x * 2
        torch._dynamo.graph_break()  # the rest is a second function (a resume frame) dynamo compiles on its own
        return y + 1

    compat.reset_dynamo()
    assert compat.dynamo_compile_counts()["compiles"] == 0
    fn = torch.compile(f, backend="eager", dynamic=False)
    for n in (2, 3, 3):  # a new length compiles both frames again; a length seen before does not
        torch.testing.assert_close(fn(torch.ones(n)), torch.full((n,), 3.0))
    counts = compat.dynamo_compile_counts()
    assert counts["compiles"] == 4 and counts["recompiles"] == 2 and counts["most_of_one"] == 2
    assert counts["graphs"] == 4 and counts["graph_breaks"] >= 1 and counts["frames_at_limit"] == 0
    compat.reset_dynamo()
    assert compat.dynamo_compile_counts() == dict.fromkeys(counts, 0)


def test_dataset_source_rows_reads_a_filters_index_mapping():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"x": i} for i in range(6)])
    assert compat.dataset_source_rows(ds) == list(range(6))
    kept = ds.map(lambda r: {"y": r["x"] * 2}).filter(lambda r: r["x"] % 3 != 1)  # TRL: map (tokenize), then filter
    assert compat.dataset_source_rows(kept) == [0, 2, 3, 5] == kept["x"]


def test_keep_train_column_extends_trls_signature_columns(tmp_path):
    pytest.importorskip("trl")
    from tests.dist_scripts.posttrain_common import build_trainer

    trainer = build_trainer("dpo", tmp_path, max_steps=1)
    compat.keep_train_column(trainer, "extra")
    compat.keep_train_column(trainer, "extra")
    assert trainer._signature_columns[:3] == ["prompt_ids", "chosen_ids", "rejected_ids"]
    assert trainer._signature_columns.count("extra") == 1
    kept = trainer._remove_unused_columns(trainer.train_dataset.add_column("extra", [0] * len(trainer.train_dataset)))
    assert "extra" in kept.column_names and "prompt" not in kept.column_names
