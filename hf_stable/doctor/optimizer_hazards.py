"""Optimization hazards: a learning rate far outside the usual range for the optimizer, an effective batch the LR
was not tuned at (or larger than the data), and two gradient clippers at once. Read from the resolved training
values and the config sections only; `hazards.check_hazards` runs them with the other config hazards."""

from __future__ import annotations

from hf_stable.config.doctor import DoctorConfig
from hf_stable.distributed import launch_world_size
from hf_stable.doctor.findings import Finding
from hf_stable.doctor.settings import TrainingSettings

# Learning rates outside these envelopes are "far outside the usual range" (base LR, the top of the LLRD
# ladder). Lion's sign update has a fixed magnitude per element, hence its 3-10x smaller LR than AdamW.
USUAL_LR = {
    "adamw": {"lora": (1e-6, 3e-3), "full": (1e-7, 3e-4)},
    "lion": {"lora": (1e-7, 3e-4), "full": (1e-8, 1e-4)},
    "sgd": {"lora": (1e-4, 1.0), "full": (1e-5, 0.3)},
}
# How the LR follows the effective batch (hf_stable.optim.rescale_lr): linear keeps SGD's per-sample step,
# sqrt keeps the update noise of Adam-type optimizers roughly constant. Heuristics, not laws.
LR_RULE = {"adamw": "sqrt", "lion": "sqrt", "sgd": "linear"}
_CLIP_SECTIONS = ("clip", "clipping", "grad_clip", "module_clip", "per_module_clip")


def _f(severity: str, name: str, what: str, evidence: str = "", fix: str = "") -> Finding:
    return Finding(severity, what, evidence, fix, check=f"hazards.{name}")


def check_learning_rate(cfg, s: TrainingSettings) -> list[Finding]:
    name, lr = cfg.optim.name, s.learning_rate
    kind = "lora" if cfg.lora.enabled else "full"
    lo, hi = USUAL_LR.get(name, USUAL_LR["adamw"])[kind]
    evidence = f"training.learning_rate={lr:g} with optim.name={name} ({kind} fine-tune); usual {lo:g} .. {hi:g}"
    if lo <= lr <= hi:
        return [_f("ok", "learning_rate", f"learning rate {lr:g} is in the usual range for {name}", evidence)]
    if name == "lion" and lr > hi:
        what, fix = (
            f"Lion with an AdamW-sized learning rate ({lr:g})",
            f"Lion wants a 3-10x smaller LR than AdamW: try {lr / 10:.2g} .. {lr / 3:.2g}",
        )
    elif lr > hi:
        what, fix = f"learning rate {lr:g} is far above the usual range for {name}", f"try <= {hi:g}"
    else:
        what, fix = f"learning rate {lr:g} is far below the usual range for {name}", f"try >= {lo:g}"
    return [_f("warning", "learning_rate", what, evidence, fix)]


def check_effective_batch(cfg, s: TrainingSettings, doctor: DoctorConfig, n_train: int | None = None) -> list[Finding]:
    from hf_stable.optim import rescale_lr

    eff, rule, lr = s.effective_batch, LR_RULE.get(cfg.optim.name, "sqrt"), s.learning_rate
    formula = "b_new/b_old" if rule == "linear" else "sqrt(b_new/b_old)"
    ranks = launch_world_size()
    evidence = (
        f"{s.micro_batch} per device x {s.accumulation} accumulation x {ranks} process(es) = {eff}; "
        f"LR rule for {cfg.optim.name}: {rule} (lr x {formula})"
    )
    out = []
    ref = doctor.reference_batch
    if ref is not None and ref != eff:
        new = rescale_lr(lr, ref, eff, rule)
        out.append(
            _f(
                "warning",
                "effective_batch",
                f"effective batch {eff} differs from the {ref} the LR was tuned at",
                f"{evidence}; training.learning_rate={lr:g}",
                f"set training.learning_rate: {new:.3g} ({rule} rule), or keep the batch at {ref}",
            )
        )
    if n_train is not None and eff > n_train:
        out.append(
            _f(
                "warning",
                "effective_batch",
                f"effective batch {eff} is larger than the training set",
                f"{n_train} training samples; every step sees the whole set",
                "lower per_device_train_batch_size / gradient_accumulation_steps or add data",
            )
        )
    if not out:
        out.append(
            _f(
                "info",
                "effective_batch",
                f"effective batch {eff} at learning rate {lr:g}",
                evidence + ("" if ref is None else f"; matches doctor_checks.reference_batch={ref}"),
                "when the batch changes (more GPUs, accumulation), rescale the LR with hf_stable.optim.rescale_lr",
            )
        )
    return out


def hf_stable_clipping(cfg) -> str | None:
    """The name of an enabled hf_stable clipping section under `stability.guards`, else None."""
    guards = getattr(getattr(cfg, "stability", None), "guards", None)
    if guards is None or not getattr(guards, "enabled", True):
        return None
    for name in _CLIP_SECTIONS:
        section = getattr(guards, name, None)
        if section is not None and getattr(section, "enabled", bool(section)):
            return f"stability.guards.{name}"
    return None


def check_double_clipping(cfg, s: TrainingSettings) -> list[Finding]:
    """The recipe sets max_grad_norm=0 when hf_stable clips, so only a value the user wrote (or arguments handed
    in by a script of their own) can clip twice."""
    section = hf_stable_clipping(cfg)
    if "max_grad_norm" in s.explicit:
        norm, where = float(cfg.training.get("max_grad_norm") or 0.0), "set in training:"
    elif s.from_caller:
        norm, where = float(s.get("max_grad_norm", 0.0) or 0.0), "in the TrainingArguments passed in"
    else:
        norm, where = 0.0, ""
    if section is None or norm <= 0:
        return []
    return [
        _f(
            "warning",
            "double_clipping",
            "two gradient clippers: Trainer's max_grad_norm and hf_stable's",
            f"training.max_grad_norm={norm:g} ({where}) and {section}.enabled; the Trainer clips first, so "
            "hf_stable's per-group thresholds see already-clipped gradients",
            "set training.max_grad_norm: 0 and let hf_stable clip",
        )
    ]
