"""hf-stable doctor's dry run on a real tiny LoRA model: restores weights, names frozen and dead parameters."""

from __future__ import annotations

import pytest
import torch

from hf_stable.config import DEFAULT_CONFIG, load_config
from hf_stable.config.doctor import DoctorConfig
from hf_stable.data import build_data
from hf_stable.doctor import REPORT_JSON, DoctorBlockingError, preflight, render_text, run_doctor
from hf_stable.doctor.dry_run import dry_run
from hf_stable.doctor.settings import resolve_settings
from hf_stable.modeling import apply_lora, load_model, load_tokenizer, resolve_base
from tests.helpers import by_check, make_workdir, strict_json, tiny_args


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = make_workdir(tmp_path_factory.mktemp("doctor_dry"))
    cfg = load_config(DEFAULT_CONFIG, tiny_args(tmp))
    base = resolve_base(cfg.model)
    tok = load_tokenizer(cfg.model, base)
    data = build_data(cfg.data, tok, seed=0)
    return tmp, cfg, base, tok, data


def fresh_model(cfg, base):
    torch.manual_seed(0)
    return apply_lora(load_model(cfg, base), cfg.lora)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_dry_run_restores_the_model_and_gives_a_clean_bill(setup):
    tmp, cfg, base, tok, data = setup
    model = fresh_model(cfg, base)
    model.eval()
    before, rng = snapshot(model), torch.get_rng_state()

    report = run_doctor(cfg, model=model, tokenizer=tok, data=data, output_dir=tmp / "out")

    after = model.state_dict()
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == []
    assert all(p.grad is None for p in model.parameters())
    assert not model.training  # mode restored
    assert torch.equal(rng, torch.get_rng_state())
    # ...and the run really trained: LoRA B starts at zero, so A only gets a gradient once B has moved
    facts = report.facts["dry_run"]
    assert facts["steps"] == DoctorConfig().dry_run_steps
    assert min(v["mean"] for g, v in facts["grad_norms"].items() if g.endswith("lora_A")) > 0
    assert all(torch.count_nonzero(v) == 0 for k, v in after.items() if "lora_B" in k)

    assert report.exit_code == 0, render_text(report)
    for check in ("dry_run.loss", "dry_run.gradients", "hazards.lora_targets"):  # targets read off the PEFT model
        assert [f.severity for f in by_check(report, check)] == ["ok"], check
    assert by_check(report, "dry_run.grad_norms") and by_check(report, "dry_run.throughput")
    memory = facts["memory"]
    assert memory["micro_batch"] == 8 and memory["peak_2b_mib"] >= memory["peak_b_mib"] > 0
    saved = strict_json((tmp / "out" / REPORT_JSON).read_text())
    assert saved["facts"]["dry_run"]["losses"] == pytest.approx(facts["losses"])


def test_dry_run_names_frozen_and_dead_parameters(setup):
    _, cfg, base, _, data = setup
    model = fresh_model(cfg, base)
    names = dict(model.named_parameters())
    frozen = next(n for n in names if "layers.0.self_attn.q_proj.lora_B" in n)
    starved_a = frozen.replace("lora_B", "lora_A")  # its B is frozen at zero, so A's gradient is always zero
    zeroed = next(n for n in names if "layers.1.self_attn.v_proj.lora_B" in n)
    names[frozen].requires_grad_(False)
    names[zeroed].register_hook(torch.zeros_like)  # in the graph, but its gradient never arrives
    before = snapshot(model)

    _facts, findings = dry_run(
        model, data, cfg, resolve_settings(cfg), DoctorConfig(dry_run_steps=3, memory_probe=False)
    )
    by = {f.check: f for f in findings}
    assert by["dry_run.frozen_adapter"].severity == "error" and frozen in by["dry_run.frozen_adapter"].evidence
    dead = by["dry_run.dead_parameters"]
    # the zeroed B never moves from zero either, so its A starves too: 3 names, no more
    assert dead.severity == "error" and "3 trainable parameter(s)" in dead.what
    for name in (starved_a, zeroed, zeroed.replace("lora_B", "lora_A")):
        assert name in dead.evidence
    healthy = next(n for n in names if "layers.0.self_attn.k_proj.lora_A" in n)
    assert healthy not in dead.evidence
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_preflight_refuses_to_start_unless_overridden(setup):
    tmp, _, base, tok, data = setup
    argv = ["--training.fp16", "true", "--training.adam_epsilon", "1e-8", "--optim.fp16_eps_guard", "error"]
    cfg = load_config(DEFAULT_CONFIG, tiny_args(tmp, "llama", *argv), check=False)  # the recipe refuses it at load
    args = resolve_settings(cfg).args
    model = fresh_model(cfg, base)
    with pytest.raises(DoctorBlockingError, match="hazards.fp16_adam_eps"):
        preflight(cfg, args, model=model, tokenizer=tok, data=data)
    saved = strict_json((tmp / "out" / REPORT_JSON).read_text())
    assert saved["exit_code"] == 1
    cfg.doctor_checks = DoctorConfig(allow_blocking=True, dry_run=False)  # the RunConfig section, once added
    report = preflight(cfg, args, model=model, tokenizer=tok, data=data)
    assert report.blocking and not by_check(report, "dry_run.skipped")


def test_dry_run_under_bf16_on_cpu_autocasts_like_the_trainer(setup):
    """Training autocasts bf16 on CPU (`precision.training_autocast`); the dry run must measure that same path."""
    import dataclasses

    from hf_stable.precision import training_autocast

    _, cfg, base, _, data = setup
    model = fresh_model(cfg, base)
    s = resolve_settings(cfg)
    s = dataclasses.replace(s, values={**s.values, "bf16": True, "fp16": False})
    device = next(model.parameters()).device
    with training_autocast(s, device):
        trainer_dtype = torch.nn.Linear(4, 4)(torch.ones(1, 4)).dtype
    seen = []
    layer = next(m for n, m in model.named_modules() if n.endswith("q_proj.base_layer"))
    handle = layer.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    try:
        dry_run(model, data, cfg, s, DoctorConfig(dry_run_steps=1, memory_probe=False))
    finally:
        handle.remove()
    assert device.type == "cpu" and trainer_dtype == torch.bfloat16
    assert seen and set(seen) == {trainer_dtype}
