"""`run_doctor`: environment → config hazards → dry run, as one report; `preflight` for the recipe.

Every check turns its failure into a finding instead of an exception: a doctor that crashes on the broken
config it was asked to diagnose is no use. Checks that need something an earlier one could not provide (no
model because the LoRA targets match nothing, no data because the file is malformed) are skipped with a note.
"""

from __future__ import annotations

import time
import traceback

from hf_stable.config.doctor import DoctorConfig
from hf_stable.doctor.dry_run import dry_run as run_dry_run
from hf_stable.doctor.environment import check_environment
from hf_stable.doctor.findings import DoctorReport, Finding
from hf_stable.doctor.hazards import check_hazards
from hf_stable.doctor.memory_estimate import memory_findings
from hf_stable.doctor.probes import meta_model, meta_model_facts, meta_model_from_config, model_facts, shipped_shape
from hf_stable.doctor.report import render_text, save_report
from hf_stable.doctor.settings import doctor_settings, resolve_settings
from hf_stable.doctor.stage_checks import stage_findings
from hf_stable.doctor.untrained_tokens import CHECK as UNTRAINED_CHECK
from hf_stable.doctor.untrained_tokens import check_untrained_tokens, untrained_findings
from hf_stable.errors import HfStableError
from hf_stable.hub import HubUnreachableError, hub_offline
from hf_stable.logging import get_logger, is_main_process, print_main

logger = get_logger(__name__)


class DoctorBlockingError(HfStableError):
    """The doctor found a blocking problem and `doctor_checks.allow_blocking` is off (the recipe refuses to start)."""


def _crash(check: str, what: str, e: BaseException) -> Finding:
    if isinstance(e, HfStableError):
        return Finding("error", what, str(e), "fix the problem named above", check=check)
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    loc = f" at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where else ""
    return Finding("error", what, f"{type(e).__name__}: {e}{loc}", "report this with the config attached", check=check)


def _shipped_meta_model(report: DoctorReport, cfg):
    """The meta model from the shapes hf_stable ships for `model.name_or_path` (the Hub is out of reach and the
    config is not cached), said in an info row; None (also said) for a model it ships none for."""
    name = cfg.model.name_or_path
    shape = shipped_shape(name)
    if shape is None:
        report.add(
            Finding(
                "info",
                "model checks and memory estimate: not made (the model's config.json is neither cached nor "
                "among the shapes hf_stable ships)",
                f"model.name_or_path={name}",
                check="hazards.model",
            )
        )
        return None
    report.add(
        Finding(
            "info",
            f"model checks and memory estimate from the shapes hf_stable ships for {name} (the Hub is out of reach)",
            f"hf_stable/doctor/shapes/{name.replace('/', '--')}.json",
            check="hazards.model",
        )
    )
    return meta_model_from_config(shape, cfg.model.trust_remote_code)


def data_file_findings(cfg) -> list[Finding]:
    """Without a tokenizer: the data files exist and their lines are good records (`read_records`), one row each."""
    from hf_stable.data.holdout import AUTO, resolve_eval_file
    from hf_stable.data.records import read_records

    files = [("data.train_file", cfg.data.train_file)]
    eval_file = resolve_eval_file(cfg.data.train_file, cfg.data.eval_file)
    if eval_file and eval_file != AUTO:
        files.append(("data.eval_file", eval_file))
    out = []
    for key, path in files:
        try:
            read = read_records(
                path, config_field=key, format=cfg.data.format, on_bad_record=cfg.data.on_bad_record, clean=False
            )
        except HfStableError as e:
            first, _, rest = str(e).partition("\n")
            fix = rest.strip() or f"set {key} to a JSONL file (alpaca or chat/messages records)"
            out.append(Finding("error", f"{key} cannot be read", first, fix, check="hazards.data"))
            continue
        skipped = f", {sum(read.skipped.values())} bad lines skipped" if read.skipped else ""
        out.append(
            Finding(
                "info",
                f"{key}: {len(read.records)} {read.format} records read{skipped}; tokenization not checked "
                "(no tokenizer)",
                str(path),
                check="hazards.data",
            )
        )
    return out


def _held_out(data_cfg) -> bool:
    from hf_stable.data.holdout import AUTO, resolve_eval_file

    return resolve_eval_file(data_cfg.train_file, data_cfg.eval_file) == AUTO


def audit_command(cfg, path) -> str:
    """The `hf-stable audit` command that shows the records of `path` as this config reads them."""
    import shlex

    tokenizer = cfg.model.tokenizer or cfg.model.name_or_path
    words = ["hf-stable", "audit", str(path), "--tokenizer", str(tokenizer), "--max-length", str(cfg.data.max_length)]
    if cfg.data.on_bad_record == "skip":
        words.append("--skip-bad")
    return shlex.join(words)


def config_findings(cfg) -> list[Finding]:
    """The checks `load_config` runs (`hf_stable.config.checks`), one blocking finding per problem."""
    from hf_stable.config.checks import config_problems

    try:
        problems = config_problems(cfg)
    except Exception as e:
        return [_crash("hazards.config", "the config checks failed", e)]
    out = []
    for problem in problems:
        key, _, what = problem.partition(": ")
        out.append(
            Finding(
                "error",
                what or key,
                key,
                f"fix {key}; the recipe refuses to start until it is fixed",
                check="hazards.config",
            )
        )
    return out


def run_doctor(
    cfg,
    *,
    dry_run: bool = True,
    args=None,
    model=None,
    tokenizer=None,
    data=None,
    collator=None,
    settings: DoctorConfig | None = None,
    output_dir=None,
    untrained=None,
) -> DoctorReport:
    """Run every preflight check on a `RunConfig` and return the findings.

    Args:
        cfg: the run's `RunConfig` (e.g. from `load_config`).
        dry_run: run the few-step dry run (also needs `settings.dry_run`); False = environment and hazards only.
        args: the recipe's `TrainingArguments` (built from `cfg` when None).
        model: the model to train, already LoRA-wrapped (loaded from `cfg` when None). Its trainable weights
            are restored after the dry run.
        tokenizer, data: the run's tokenizer and `DataBundle` (built from `cfg` when None).
        collator: the data collator training will use (default: `data.collator`, hf_stable's own). Pass a
            user collator to check that it supervises EOS and pads on the right.
        settings: the doctor's thresholds (default: `cfg.doctor_checks` when present, else `DoctorConfig()`).
        output_dir: when given, `doctor_report.json` / `.md` are written there.
        untrained: the recipe's `UntrainedTokens` (found before LoRA, possibly repaired since); None: the doctor
            checks the model's rows, or without a model the base's rows read from disk.

    Returns:
        A `DoctorReport`; `report.exit_code` is 1 when a blocking (error) finding exists.

    Example:
        >>> report = run_doctor(load_config("configs/default.yaml"))
        >>> report.exit_code, [f.what for f in report.blocking_findings()]
        (0, [])
        >>> print(render_text(report))
    """
    started = time.time()
    doctor = doctor_settings(cfg, settings)
    report = DoctorReport(config_source=getattr(cfg, "source", None))
    s = resolve_settings(cfg, args, remove_unused_columns=False)

    report.add(config_findings(cfg))
    try:
        env_facts, env_findings = check_environment(cfg, s, doctor)
        report.facts["environment"] = env_facts
        report.add(env_findings)
    except Exception as e:  # a driver in a bad state must not hide the config checks
        report.add(_crash("environment.crash", "the environment could not be read", e))

    base = hub_down = None
    if model is None or tokenizer is None:
        try:
            from hf_stable.modeling import load_tokenizer, resolve_base

            base = resolve_base(cfg.model)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model, base)
        except HubUnreachableError as e:  # the environment, not a bug: the ways out, and the checks go on
            hub_down = e
            report.add(Finding("error", e.what, f"HF_HUB_OFFLINE={hub_offline()}", e.ways_out, check="hazards.model"))
        except Exception as e:
            report.add(_crash("hazards.model", "the base model / tokenizer cannot be loaded", e))
    facts = meta = None
    try:
        if model is None and base:
            meta = meta_model(cfg, base)
        elif model is None and hub_down is not None:
            meta = _shipped_meta_model(report, cfg)
        facts = model_facts(model) if model is not None else meta_model_facts(cfg, base, meta) if meta else None
    except Exception as e:
        report.add(_crash("hazards.model", "the model config cannot be read", e))
    if cfg.stage != "sft":  # dpo / grpo: reference, pairs, prompts, rewards, lengths (`stage_checks`)
        report.add(stage_findings(cfg, tokenizer, model if model is not None else meta))
    elif data is None and tokenizer is None:
        report.add(data_file_findings(cfg))  # what can be checked without a tokenizer: the files and their lines
    elif data is None:  # SFT with a tokenizer: build the data as the recipe will
        try:
            from hf_stable.data import build_data

            # a batch size < 1 is a config finding already; the audit's padding simulation needs one >= 1
            batch = max(1, s.micro_batch)
            data = build_data(cfg.data, tokenizer, seed=int(s.get("seed", 42)), batch_size=batch)
        except Exception as e:
            report.add(_crash("hazards.data", "the training data cannot be built", e))
    if data is not None:
        report.facts["data"] = {"train_samples": len(data.train_dataset), "stats": getattr(data, "stats", {})}
        for name, audit in (getattr(data, "audit", None) or {}).items():
            path = getattr(cfg.data, f"{name}_file", None)
            # the file the audit read: an eval split held out of the train file is audited there
            source = cfg.data.train_file if name == "eval" and _held_out(cfg.data) else path
            for alert in (audit or {}).get("alerts", []):
                report.add(
                    Finding(
                        "warning",
                        f"data audit ({name}): {alert}",
                        f"data.{name}_file={path}",
                        f"inspect it record by record: `{audit_command(cfg, source)}`",
                        check="hazards.data_audit",
                    )
                )
    try:
        if untrained is not None:
            report.add(untrained_findings(untrained, cfg.model.untrained_tokens))
        else:
            report.add(check_untrained_tokens(cfg, model=model, base=base, meta=meta, tokenizer=tokenizer, data=data))
    except Exception as e:
        report.add(_crash(UNTRAINED_CHECK, "the untrained-token check failed", e))
    try:
        report.add(
            check_hazards(
                cfg,
                s,
                doctor,
                facts=facts,
                tokenizer=tokenizer,
                collator=collator if collator is not None else getattr(data, "collator", None),
                n_train=len(data.train_dataset) if data is not None else None,
            )
        )
    except Exception as e:
        report.add(_crash("hazards.crash", "a config check failed", e))
    try:
        report.add(memory_findings(cfg, s, doctor, model=model, meta_model=meta))
    except Exception as e:
        report.add(_crash("hazards.memory_estimate", "the memory estimate failed", e))

    if dry_run and doctor.dry_run and cfg.stage == "sft":  # the dry run trains SFT steps
        _dry_run(report, cfg, s, doctor, base, model, data)
    report.seconds = time.time() - started
    if output_dir is not None and is_main_process():
        save_report(report, output_dir)
    return report


def _dry_run(report: DoctorReport, cfg, s, doctor: DoctorConfig, base, model, data) -> None:
    blockers = [f.check for f in report.blocking_findings()]
    if blockers or data is None:
        why = ", ".join(sorted(set(blockers))) or "no data"
        report.add(
            Finding("info", "dry run skipped until the blocking findings are fixed", why, check="dry_run.skipped")
        )
        return
    sharded = [k for k in ("deepspeed", "fsdp") if s.get(k)]
    if sharded:
        report.add(
            Finding(
                "info",
                f"dry run skipped: training.{sharded[0]} shards the model only once the Trainer wraps it",
                f"training.{sharded[0]}={s.get(sharded[0])!r}",
                "run `hf-stable doctor` without the sharding keys on one GPU (smaller micro-batch) to dry-run the rest",
                check="dry_run.skipped",
            )
        )
        return
    try:
        if model is None:
            from transformers import set_seed

            from hf_stable.modeling import apply_lora, load_model

            cfg, s = _cpu_float32(report, cfg, s)
            set_seed(int(s.get("seed", 42)))  # the LoRA init is random: seed it so the report is reproducible
            model = load_model(cfg, base)
            model = apply_lora(model, cfg.lora, s.gradient_checkpointing, quantization=cfg.model.quantization)
        facts, findings = run_dry_run(model, data, cfg, s, doctor)
    except Exception as e:
        report.add(_crash("dry_run.crash", "the dry run failed", e))
        return
    report.facts["dry_run"] = facts
    report.add(findings)


def _cpu_float32(report: DoctorReport, cfg, s):
    """The doctor's own model for a dry run on a CPU without native bf16 matmul: loaded and run in fp32.

    A bf16 step there runs torch's reference kernel (minutes per step for a 7B-shaped layer, see
    `precision.cpu_has_fast_bf16`); what the dry run answers (gradients reach every trained weight, the loss is
    finite) does not need the bf16 numerics. The bf16 slowness itself is an environment warning."""
    import copy
    import dataclasses

    import torch

    from hf_stable.precision import cpu_has_fast_bf16

    q = cfg.model.quantization
    bf16 = s.bf16 or cfg.model.dtype == "bfloat16" or (q.enabled and q.compute_dtype == "bfloat16")
    if torch.cuda.is_available() or not bf16 or cpu_has_fast_bf16():
        return cfg, s
    was = f"training.bf16={s.bf16}, model.dtype={cfg.model.dtype}"
    was += f", model.quantization.compute_dtype={q.compute_dtype}" if q.enabled else ""
    cfg = copy.deepcopy(cfg)
    if cfg.model.dtype == "bfloat16":
        cfg.model.dtype = "float32"
    if q.enabled and q.compute_dtype == "bfloat16":
        cfg.model.quantization.compute_dtype = "float32"
    report.add(
        Finding(
            "info",
            "dry run computed in fp32: this CPU has no native bf16 matmul",
            was,
            "the bf16 numerics are exercised by the run itself on a GPU",
            check="dry_run.precision",
        )
    )
    return cfg, dataclasses.replace(s, values={**s.values, "bf16": False})


def blocking_on_any_rank(report: DoctorReport) -> bool:
    """True when any rank's report blocks, so every rank takes the same start/refuse decision (no DDP hang)."""
    from hf_stable.distributed import all_reduce_flag

    return all_reduce_flag(report.blocking)


def preflight(cfg, args, *, model, tokenizer, data, output_dir=None, untrained=None) -> DoctorReport:
    """The recipe's one call: run the doctor on the built pieces, print and save the report, refuse to start
    on a blocking finding unless `doctor_checks.allow_blocking` is set.

    Raises:
        DoctorBlockingError: a blocking finding on any rank, with the findings in the message.
    """
    doctor = doctor_settings(cfg)
    try:
        report = run_doctor(
            cfg,
            args=args,
            model=model,
            tokenizer=tokenizer,
            data=data,
            output_dir=output_dir or args.output_dir,
            untrained=untrained,
        )
    except BaseException:
        from hf_stable.distributed import all_reduce_flag

        all_reduce_flag(True)  # the other ranks wait in the same collective: they refuse too, instead of hanging
        raise
    print_main(render_text(report))
    if blocking_on_any_rank(report):
        lines = [f"{f.check}: {f.what} ({f.evidence}) -> {f.fix}" for f in report.blocking_findings()]
        lines = lines or ["another rank found a blocking problem (its report is printed on that rank)"]
        if doctor.allow_blocking:
            logger.warning(
                "doctor found blocking problems; starting anyway (doctor_checks.allow_blocking):\n%s", "\n".join(lines)
            )
        else:
            raise DoctorBlockingError(
                "the preflight doctor found blocking problems (report in doctor_report.md):\n  - "
                + "\n  - ".join(lines)
                + "\nFix them, or set doctor_checks.allow_blocking: true to train anyway."
            )
    return report
