"""The doctor's quick checks at recipe start: the config hazards that need no model, data or dry run (a learning
rate far out of range, fp16 with an eps below its resolution, two gradient clippers, ...), one WARNING line each in
the doctor's own words. The full preflight (`doctor: true`: environment, data, dry run) stays opt-in; these checks
are the same functions it runs (`hazards.check_hazards` without model facts, tokenizer or collator)."""

from __future__ import annotations

from hf_stable.doctor.findings import Finding
from hf_stable.logging import get_logger

logger = get_logger("doctor")


def quick_findings(cfg, args=None) -> list[Finding]:
    """The warning- and error-level findings of the config hazards (nothing that needs the model or the data)."""
    from hf_stable.doctor.hazards import check_hazards
    from hf_stable.doctor.settings import doctor_settings, resolve_settings

    settings = resolve_settings(cfg, args)
    if getattr(settings, "error", None):  # the config's own validation reports it
        return []
    found = check_hazards(cfg, settings, doctor_settings(cfg))
    return [f for f in found if f.severity in ("warning", "error")]


def finding_line(f: Finding) -> str:
    """e.g. "doctor: learning rate 1 is far above the usual range for adamw (training.learning_rate=1 ...); try <=
    0.003" - the words of `hf-stable doctor`'s table row."""
    evidence = f" ({f.evidence})" if f.evidence else ""
    fix = f"; {f.fix}" if f.fix else ""
    return f"doctor: {f.what}{evidence}{fix}"


def warn_quick_checks(cfg, args=None) -> list[str]:
    """Log one WARNING line per quick finding (main process) and return the lines. Never raises: a check that fails
    must not stop a run the full doctor was not asked for."""
    try:
        lines = [finding_line(f) for f in quick_findings(cfg, args)]
    except Exception as e:
        logger.debug("quick doctor checks skipped: %s", e)
        return []
    for line in lines:
        logger.warning("%s", line)
    return lines
