"""hf-stable doctor: config hazards (each found on a constructed config, absent on the default), CLI and JSON."""

from __future__ import annotations

import math

import pytest
import torch

from hf_stable.config import DEFAULT_CONFIG, load_config
from hf_stable.config.doctor import DoctorConfig
from hf_stable.data import PaddingCollator
from hf_stable.doctor import REPORT_JSON, REPORT_MD, main, render_markdown, render_text, run_doctor, save_report
from hf_stable.doctor.environment import numa_cpus, parse_cpulist, sysfs_bus_id
from hf_stable.doctor.hazards import check_collator, check_fp16_eps, check_learning_rate
from hf_stable.doctor.settings import resolve_settings
from tests.helpers import by_check, make_workdir, strict_json, tiny_args


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("doctor"))


def test_default_config_has_no_hazard(workdir):
    report = run_doctor(load_config(DEFAULT_CONFIG, tiny_args(workdir)), dry_run=False)
    hazards = [f for f in report.findings if f.section == "hazards"]
    assert not [f for f in hazards if f.severity in ("warning", "error")], render_text(report)
    for check in ("eos_supervision", "lora_targets", "learning_rate"):
        assert [f.severity for f in by_check(report, f"hazards.{check}")] == ["ok"], check
    for check in ("fp16_adam_eps", "fp16_family", "padding_side", "double_clipping", "checkpointing"):
        assert not by_check(report, f"hazards.{check}"), check
    assert report.exit_code == 0
    if not torch.cuda.is_available():
        assert "CPU-only" in by_check(report, "environment.accelerator")[0].what


def test_broken_config_reports_every_hazard(workdir):
    cfg = load_config(
        DEFAULT_CONFIG,
        tiny_args(
            workdir,
            "qwen2",
            "--training.fp16",
            "true",
            "--training.adam_epsilon",
            "1e-8",
            "--optim.fp16_eps_guard",
            "warn",
            "--lora.target_modules",
            "[q_proj, v_proj, wq]",
            "--training.learning_rate",
            "5e-2",
            "--training.max_grad_norm",
            "1.0",
            "--training.gradient_checkpointing",
            "true",
            "--training.gradient_checkpointing_kwargs",
            "{use_reentrant: true}",
        ),
    )
    report = run_doctor(cfg, dry_run=False, settings=DoctorConfig(reference_batch=64))
    expect = {
        "hazards.fp16_adam_eps": "warning",
        "hazards.fp16_family": "warning",
        "hazards.lora_targets": "warning",
        "hazards.learning_rate": "warning",
        "hazards.effective_batch": "warning",
        "hazards.double_clipping": "warning",
        "hazards.checkpointing": "warning",
    }
    for check, severity in expect.items():
        assert [f.severity for f in by_check(report, check)] == [severity], (check, render_text(report))
    assert "qwen2" in by_check(report, "hazards.fp16_family")[0].what
    assert "['wq']" in by_check(report, "hazards.lora_targets")[0].what
    # effective batch 8 vs 64 the LR was tuned at: sqrt rule for AdamW -> 5e-2 * sqrt(8/64)
    assert f"{5e-2 * math.sqrt(8 / 64):.3g}" in by_check(report, "hazards.effective_batch")[0].fix
    assert report.exit_code == 0  # warnings do not block


def test_lion_wants_a_smaller_lr_than_adamw():
    for name, severity in (("adamw", "ok"), ("lion", "warning")):
        cfg = load_config(DEFAULT_CONFIG, ["--optim.name", name, "--training.learning_rate", "1e-3"])
        (finding,) = check_learning_rate(cfg, resolve_settings(cfg))
        assert finding.severity == severity, name
    assert "Lion" in finding.what and "3-10x" in finding.fix
    cfg = load_config(DEFAULT_CONFIG, ["--optim.name", "lion", "--training.learning_rate", "1e-4"])
    assert check_learning_rate(cfg, resolve_settings(cfg))[0].severity == "ok"


@pytest.mark.parametrize("guard,severity", [("clamp", "info"), ("warn", "warning"), ("error", "error")])
def test_fp16_adam_eps_severity_follows_the_guard(guard, severity):
    argv = ["--training.fp16", "true", "--training.adam_epsilon", "1e-8", "--optim.fp16_eps_guard", guard]
    cfg = load_config(DEFAULT_CONFIG, argv, check=False)  # with guard "error", load_config itself refuses it
    assert [f.severity for f in check_fp16_eps(cfg, resolve_settings(cfg))] == [severity]
    fine = load_config(DEFAULT_CONFIG, [*argv[:2], "--training.adam_epsilon", "1e-6"])
    assert check_fp16_eps(fine, resolve_settings(fine)) == []


def test_lora_targets_matching_nothing_block_and_skip_the_dry_run(workdir):
    cfg = load_config(DEFAULT_CONFIG, tiny_args(workdir, "llama", "--lora.target_modules", "[wq, wk]"))
    report = run_doctor(cfg, dry_run=True)
    (finding,) = by_check(report, "hazards.lora_targets")
    assert finding.severity == "error" and "q_proj" in finding.evidence
    assert by_check(report, "dry_run.skipped") and not by_check(report, "dry_run.gradients")
    assert report.exit_code == 1


def test_pad_eos_and_padding_side(workdir, tokenizer_pad_eos):
    from transformers import DataCollatorForLanguageModeling

    tok = tokenizer_pad_eos
    (ours,) = check_collator(tok, PaddingCollator(tok.pad_token_id))
    assert ours.severity == "info" and "pad == eos: safe" in ours.what
    # transformers' LM collator masks every pad id, so with pad == eos no EOS is ever learned
    (theirs,) = check_collator(tok, DataCollatorForLanguageModeling(tok, mlm=False))
    assert theirs.check == "hazards.eos_supervision" and theirs.severity == "warning"
    left = check_collator(tok, PaddingCollator(tok.pad_token_id, padding_side="left"))
    assert [f.check for f in left if f.severity == "warning"] == ["hazards.padding_side"]
    # the same checks from the Python API, with a user collator
    cfg = load_config(DEFAULT_CONFIG, tiny_args(workdir))
    report = run_doctor(cfg, dry_run=False, tokenizer=tok, collator=DataCollatorForLanguageModeling(tok, mlm=False))
    assert [f.severity for f in by_check(report, "hazards.eos_supervision")] == ["warning"]
    tok.padding_side = "left"
    try:
        report = run_doctor(cfg, dry_run=False, tokenizer=tok)
    finally:
        tok.padding_side = "right"
    assert [f.severity for f in by_check(report, "hazards.padding_side")] == ["warning"]
    assert [f.severity for f in by_check(report, "hazards.eos_supervision")] == ["info"]


def test_cli_json_parses_and_exit_codes(workdir, capsys):
    assert main(["--config", str(DEFAULT_CONFIG), *tiny_args(workdir), "--json", "--no-dry-run"]) == 0
    data = strict_json(capsys.readouterr().out)
    assert data["exit_code"] == 0 and data["counts"]["error"] == 0
    assert {f["check"] for f in data["findings"]} >= {"environment.versions", "hazards.lora_targets"}
    assert data["facts"]["environment"]["versions"]["torch"] == torch.__version__

    broken = tiny_args(workdir, "llama", "--lora.target_modules", "[wq]")
    out_dir = workdir / "cli_out"
    assert main(["--config", str(DEFAULT_CONFIG), *broken, "--no-dry-run", "--output", str(out_dir)]) == 1
    text = capsys.readouterr().out
    assert "== Config hazards" in text and "ERROR" in text and "BLOCKING" in text
    saved = strict_json((out_dir / REPORT_JSON).read_text())
    assert saved["exit_code"] == 1
    assert "| error | hazards.lora_targets |" in (out_dir / REPORT_MD).read_text()


def test_report_json_is_strict_even_with_nan_facts(tmp_path):
    from hf_stable.doctor import DoctorReport, Finding

    report = DoctorReport(findings=[Finding("ok", "x", check="dry_run.loss")], facts={"losses": [1.0, float("nan")]})
    data = strict_json(report.to_json())
    assert data["facts"]["losses"] == [1.0, None]
    save_report(report, tmp_path)
    assert strict_json((tmp_path / REPORT_JSON).read_text())["verdict"] == "no blocking problem"
    assert "clean bill" in render_markdown(report)
    with pytest.raises(ValueError):
        Finding("fatal", "not a severity")


def test_numa_helpers_read_sysfs(tmp_path):
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    dev = tmp_path / "bus/pci/devices/0000:3b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    node = tmp_path / "devices/system/node/node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("16-31\n")
    assert numa_cpus("00000000:3B:00.0", sysfs=tmp_path) == (1, set(range(16, 32)))
    assert numa_cpus("00000000:AA:00.0", sysfs=tmp_path) == (None, None)


def test_config_time_problems_are_blocking_findings(workdir, capsys):
    """What `load_config` refuses (hf_stable.config.checks) the doctor reports as blocking, exit code 1."""
    broken = tiny_args(
        workdir,
        "llama",
        "--training.per_device_train_batch_size",
        "0",
        "--training.report_to",
        "[none_such]",
        "--stability.guards.batch_warmup.enabled",
        "true",
    )
    assert main(["--config", str(DEFAULT_CONFIG), *broken, "--no-dry-run", "--json"]) == 1
    findings = [f for f in strict_json(capsys.readouterr().out)["findings"] if f["check"] == "hazards.config"]
    assert {f["evidence"] for f in findings} == {
        "training.per_device_train_batch_size",
        "training.report_to",
        "training.max_steps",
    }
    assert all(f["severity"] == "error" for f in findings)


def test_doctor_world_size_is_the_process_groups_once_up(tmp_path, monkeypatch):
    """The doctor counts ranks with `distributed.launch_world_size`: the launcher's WORLD_SIZE before the process
    group exists, the group's own size once it is up (a stale or absent WORLD_SIZE no longer wins)."""
    import torch.distributed as dist

    from hf_stable.doctor.settings import TrainingSettings

    s = TrainingSettings(values={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2})
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert s.effective_batch == 4 * 2 * 3  # torchrun/accelerate set it before any process group exists
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert s.effective_batch == 4 * 2 * 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_cpu_warns_only_without_native_bf16_matmul(monkeypatch, fast):
    """The 8B QLoRA recipe (bf16 compute) on a CPU-only machine: a warning where torch's bf16 matmul has no native
    kernel (an AVX2 CPU; this machine's answer is stood in for both ways, the QLoRA doctor test reads the real one)."""
    from hf_stable.doctor import precision_checks

    monkeypatch.setattr(precision_checks, "cpu_has_fast_bf16", lambda: fast)
    cfg = load_config("configs/llama3.1-8b-qlora.yaml", check=False)
    s = resolve_settings(cfg, None, remove_unused_columns=False)
    found = [f for f in precision_checks.precision_findings([], s, cfg) if "native bf16" in f.what]
    assert len(found) == (not fast)
    if found:
        assert found[0].severity == "warning" and "compute_dtype=bfloat16" in found[0].evidence
        assert "training.bf16: false" in found[0].fix
    fp32 = load_config(DEFAULT_CONFIG, check=False)  # the embedded default trains in fp32 on a CPU: nothing to say
    assert not precision_checks.precision_findings([], resolve_settings(fp32, None, remove_unused_columns=False), fp32)
