"""Config hazards: settings that are legal but known to break or silently degrade fine-tuning.

No model is run here. The checks read the resolved training values, the config sections, a weight-free view
of the model (module names, `model_type`) and two probe samples through the collator.
The optimization hazards (learning rate, effective batch, double clipping) are in `optimizer_hazards`.
"""

from __future__ import annotations

from hf_stable.config.doctor import DoctorConfig
from hf_stable.doctor.findings import Finding
from hf_stable.doctor.optimizer_hazards import check_double_clipping, check_effective_batch, check_learning_rate
from hf_stable.doctor.probes import LORA_WRAPPABLE, ModelFacts, match_targets, probe_collator
from hf_stable.doctor.settings import TrainingSettings


def _f(severity: str, name: str, what: str, evidence: str = "", fix: str = "") -> Finding:
    return Finding(severity, what, evidence, fix, check=f"hazards.{name}")


def _fp16(cfg, s: TrainingSettings) -> bool:
    return s.fp16 or cfg.model.dtype == "float16"


def check_training_arguments(s: TrainingSettings) -> list[Finding]:
    if s.error:
        return [
            _f(
                "error",
                "training_arguments",
                "transformers.TrainingArguments rejects the training section",
                s.error,
                "fix the training: values named above (or run on hardware that supports them)",
            )
        ]
    return []


def check_fp16_eps(cfg, s: TrainingSettings) -> list[Finding]:
    eps, floor, guard = float(s.get("adam_epsilon", 1e-8)), cfg.optim.fp16_eps_min, cfg.optim.fp16_eps_guard
    if not (_fp16(cfg, s) and cfg.optim.name == "adamw" and eps < floor):
        return []
    evidence = f"training.adam_epsilon={eps:g} < optim.fp16_eps_min={floor:g}; fp16's smallest subnormal is ~6e-8"
    fix = f"set training.adam_epsilon: {floor:g} (or train in bf16)"
    if guard == "clamp":
        return [
            _f(
                "info",
                "fp16_adam_eps",
                f"fp16 with AdamW eps below fp16 resolution: the optimizer factory will raise it to {floor:g}",
                evidence,
                fix,
            )
        ]
    severity = "error" if guard == "error" else "warning"
    return [
        _f(
            severity,
            "fp16_adam_eps",
            "fp16 with AdamW eps below fp16 resolution",
            f"{evidence}; optim.fp16_eps_guard={guard}",
            fix,
        )
    ]


def check_fp16_family(cfg, s: TrainingSettings, facts: ModelFacts | None, doctor: DoctorConfig) -> list[Finding]:
    if not _fp16(cfg, s) or facts is None or facts.model_type not in doctor.fp16_overflow_families:
        return []
    return [
        _f(
            "warning",
            "fp16_family",
            f"fp16 on a '{facts.model_type}' model, a family known to overflow in fp16",
            f"model_type={facts.model_type}; training.fp16={s.fp16}, model.dtype={cfg.model.dtype}",
            "train in bf16 (training.bf16: true, training.fp16: false) on a GPU with compute capability >= 8.0",
        )
    ]


def check_collator(tokenizer, collator) -> list[Finding]:
    """pad == eos with EOS supervision, and padding side (tokenizer and collator)."""
    out = []
    if tokenizer is None:
        return out
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if tokenizer.padding_side == "left":
        out.append(
            _f(
                "warning",
                "padding_side",
                "the tokenizer pads on the left for training",
                "tokenizer.padding_side='left'",
                "set tokenizer.padding_side = 'right' for training (left is for batched generation)",
            )
        )
    if collator is None:
        return out
    probe = probe_collator(collator, tokenizer)
    name = type(collator).__name__
    if probe.ok and probe.padding_side == "left":
        out.append(
            _f(
                "warning",
                "padding_side",
                f"the data collator ({name}) pads on the left for training",
                "probe: the shorter sample ends at the last column",
                "use right padding for training (hf_stable.data.PaddingCollator(pad_id))",
            )
        )
    if not probe.ok:
        out.append(
            _f(
                "warning",
                "eos_supervision",
                f"could not verify that {name} supervises EOS",
                probe.error,
                "use hf_stable's collator (hf_stable.data.build_data) or check the labels at EOS yourself",
            )
        )
    elif not probe.eos_supervised:
        why = (
            "pad == eos and the collator masks labels by token id, so every EOS is masked"
            if pad == eos
            else "the label at the final EOS is -100 (or there are no labels)"
        )
        out.append(
            _f(
                "warning",
                "eos_supervision",
                f"{name} does not supervise EOS: the model will not learn to stop",
                f"{why}; pad_token_id={pad}, eos_token_id={eos}" + (f"; {probe.error}" if probe.error else ""),
                "use hf_stable's collator, which masks padding by position (data.build_data), or give the "
                "tokenizer a pad token distinct from EOS",
            )
        )
    elif pad == eos:
        out.append(
            _f(
                "info",
                "eos_supervision",
                f"pad == eos: safe, {name} supervises EOS by position",
                f"pad_token_id = eos_token_id = {eos}; probe: EOS label kept on both samples",
            )
        )
    else:
        out.append(_f("ok", "eos_supervision", f"{name} supervises EOS", f"pad {pad} != eos {eos}; probe passed"))
    return out


def check_lora_targets(cfg, facts: ModelFacts | None) -> list[Finding]:
    if not cfg.lora.enabled or facts is None:
        return []
    matched = match_targets(cfg.lora.target_modules, facts.modules)
    missing = [t for t, names in matched.items() if not names]
    leaves = sorted({n.rsplit(".", 1)[-1] for n in facts.modules if not n.rsplit(".", 1)[-1].isdigit()})
    sample = ", ".join(x for x in leaves if x not in ("model", "layers"))[:300]
    if len(missing) == len(matched):
        return [
            _f(
                "error",
                "lora_targets",
                "lora.target_modules match no module of the model: LoRA would train nothing",
                f"target_modules={cfg.lora.target_modules}; module names include: {sample}",
                "name modules the model has (e.g. q_proj, v_proj for Llama/Qwen)",
            )
        ]
    out = []
    if missing:
        out.append(
            _f(
                "warning",
                "lora_targets",
                f"lora.target_modules {missing} match nothing (ignored)",
                f"model_type={facts.model_type}; module names include: {sample}",
                f"remove {missing} from lora.target_modules or fix their spelling",
            )
        )
    unwrappable = {
        t: sorted({facts.modules[n] for n in names})
        for t, names in matched.items()
        if names and not any(facts.modules[n] in LORA_WRAPPABLE for n in names)
    }
    if unwrappable:
        out.append(
            _f(
                "error",
                "lora_targets",
                "lora.target_modules name containers peft cannot wrap",
                "; ".join(f"{t} -> {', '.join(c)}" for t, c in unwrappable.items()),
                "target the Linear layers inside them (e.g. gate_proj, up_proj, down_proj instead of mlp)",
            )
        )
    if not out:
        n = sum(len(v) for v in matched.values())
        out.append(
            _f(
                "ok",
                "lora_targets",
                f"lora.target_modules match {n} modules",
                ", ".join(f"{t}: {len(v)}" for t, v in matched.items()),
            )
        )
    return out


def check_checkpointing(s: TrainingSettings) -> list[Finding]:
    if not s.gradient_checkpointing:
        return []
    kwargs = s.checkpointing_kwargs
    reentrant = None if kwargs is None else kwargs.get("use_reentrant", "unset")
    if reentrant is True or reentrant == "unset":
        why = (
            "use_reentrant=True" if reentrant is True else "kwargs without use_reentrant (torch then defaults to True)"
        )
        return [
            _f(
                "warning",
                "checkpointing",
                "gradient checkpointing with the reentrant implementation",
                f"training.gradient_checkpointing_kwargs={kwargs} -> {why}; the reentrant variant gives a "
                "checkpointed block no gradient unless one of its inputs requires grad (a frozen-base LoRA "
                "depends on enable_input_require_grads) and fails under DDP with find_unused_parameters "
                "('marked ready twice'); PyTorch recommends use_reentrant=False",
                "set training.gradient_checkpointing_kwargs: {use_reentrant: false}",
            )
        ]
    return [_f("ok", "checkpointing", "gradient checkpointing is non-reentrant", f"kwargs={kwargs}")]


def check_host_buffers(cfg, s: TrainingSettings, facts: ModelFacts | None) -> list[Finding]:
    """Sizes of the buffers that grow with the trainable parameters: the rollback snapshot (weights + optimizer
    state, host memory or disk) and the update monitor's device copy of the weights."""
    from hf_stable.core.snapshot_size import estimate_size, human, plan_storage

    guards = cfg.stability.guards
    if facts is None or not facts.trainable_numel:
        return []
    per = facts.trainable_bytes / facts.trainable_numel
    phases = [p.name for p in guards.phases.phases] if guards.enabled and guards.phases.enabled else [cfg.optim.name]
    size = max((estimate_size(facts.trainable_numel, round(per), name) for name in phases), key=lambda x: x.state)
    update = cfg.stability.monitors.update
    extra = (
        f"; the update monitor copies the trainable weights on the device every {update.every_n_steps} steps "
        f"({human(size.params)})"
        if cfg.stability.monitors.enabled and update.enabled
        else ""
    )
    evidence = f"{facts.trainable_numel:,} trainable parameters; {size.describe()}{extra}"
    if not (guards.enabled and guards.skip.enabled and guards.rollback.enabled):
        return [_f("info", "host_buffers", "rollback snapshots are off", evidence)]
    rb = guards.rollback
    plan = plan_storage(size, rb.storage, rb.verify, s.get("output_dir") or ".", rb.host_memory_share)
    if plan.error:
        return [
            _f(
                "error",
                "host_buffers",
                "rollback snapshots fit neither in host memory nor on disk",
                plan.error,
                "set stability.guards.rollback.enabled: false, free disk space under "
                "training.output_dir, or train LoRA (lora.enabled: true)",
            )
        ]
    if plan.note:
        return [
            _f(
                "warning",
                "host_buffers",
                f"rollback snapshots will go to {plan.storage}: too large for host memory",
                plan.note,
                "set stability.guards.rollback.storage: disk (or train LoRA)",
            )
        ]
    return [
        _f(
            "info",
            "host_buffers",
            f"rollback snapshots ({human(size.snapshot)}) fit (storage: {plan.storage})",
            evidence,
        )
    ]


def check_hazards(
    cfg,
    s: TrainingSettings,
    doctor: DoctorConfig,
    *,
    facts: ModelFacts | None = None,
    tokenizer=None,
    collator=None,
    n_train: int | None = None,
) -> list[Finding]:
    """Every config hazard; checks whose inputs are missing (no model facts, no tokenizer) are skipped."""
    out = check_training_arguments(s)
    out += check_fp16_eps(cfg, s)
    out += check_fp16_family(cfg, s, facts, doctor)
    out += check_collator(tokenizer, collator)
    out += check_lora_targets(cfg, facts)
    out += check_learning_rate(cfg, s)
    out += check_effective_batch(cfg, s, doctor, n_train)
    out += check_double_clipping(cfg, s)
    out += check_checkpointing(s)
    out += check_host_buffers(cfg, s, facts)
    return out
