"""What `hf-stable doctor` checks for a later stage (`stage: grpo`) instead of the SFT data and dry run: the stage's
start (`model.start_from`), its prompts, its rewards (importable, one finite number per completion) and whether a
prompt plus its completion fits `data.max_length`."""

from __future__ import annotations

import math

from hf_stable.doctor.findings import Finding
from hf_stable.errors import HfStableError


def _error(check: str, what: str, e: BaseException, fix: str) -> Finding:
    return Finding("error", what, str(e).splitlines()[0][:300], fix, check=f"hazards.stage.{check}")


def stage_findings(cfg, tokenizer) -> list[Finding]:
    """The doctor's findings for `cfg.stage` ('grpo'); the SFT stage's own checks do not apply to it."""
    out = [
        Finding(
            "info",
            f"stage {cfg.stage}: the dry run covers the SFT stage only",
            f"stage={cfg.stage}",
            check="hazards.stage.dry_run",
        )
    ]
    if cfg.model.start_from:
        from hf_stable.stages.start import resolve_start_from

        try:
            start = resolve_start_from(cfg.model.start_from)
            out.append(Finding("ok", f"model.start_from: {start.kind} in {start.path}", check="hazards.stage.start"))
        except HfStableError as e:
            out.append(_error("start", "model.start_from cannot be used", e, "run the earlier stage first"))
    if cfg.stage != "grpo":
        return out
    from hf_stable.data.prompts import resolve_template
    from hf_stable.rewards import resolve_rewards
    from hf_stable.stages.prompts import read_prompts, reference, render_prompt

    try:
        rows = read_prompts(cfg.data.train_file, on_bad_record=cfg.data.on_bad_record, clean=cfg.data.clean)
    except HfStableError as e:
        return [*out, _error("prompts", "the GRPO prompts cannot be read", e, "fix the line named above")]
    try:
        rewards = resolve_rewards(cfg.rewards)
    except HfStableError as e:
        return [*out, _error("rewards", "a reward function cannot be used", e, "fix rewards: in the config")]
    sample = rows[:4]
    columns = {k: [r.get(k) for r in sample] for k in sorted({k for r in sample for k in r if k != "_where"})}
    completions = [reference(r) if "answer" in r else "x" for r in sample]
    for name, fn in zip(cfg.rewards, rewards, strict=True):
        try:
            got = list(fn(completions, **columns))
        except Exception as e:  # noqa: BLE001 - the user's function: said in one line
            out.append(_error("rewards", f"reward {name} fails on the prompts' fields", e, "fix the function"))
            continue
        if len(got) != len(completions) or not all(v is None or math.isfinite(float(v)) for v in got):
            out.append(
                Finding(
                    "error",
                    f"reward {name} returns {len(got)} values for {len(completions)} completions (or a non-finite one)",
                    f"{got[:6]}",
                    "return one finite float (or None) per completion",
                    check="hazards.stage.rewards",
                )
            )
    completion = int(cfg.grpo.get("max_completion_length", 256))
    template = resolve_template(tokenizer, cfg.data.template)
    longest = max(len(tokenizer(text=render_prompt(tokenizer, r, template))["input_ids"]) for r in rows[:256])
    if longest + completion > cfg.data.max_length:
        out.append(
            Finding(
                "warning",
                "a prompt plus its completion can exceed data.max_length",
                f"longest prompt {longest} + grpo.max_completion_length {completion} > data.max_length "
                f"{cfg.data.max_length}",
                "raise data.max_length or lower grpo.max_completion_length",
                check="hazards.stage.lengths",
            )
        )
    else:
        out.append(
            Finding(
                "ok",
                f"{len(rows)} prompts, rewards {', '.join(cfg.rewards)}, prompt + completion <= {longest + completion} tokens",
                check="hazards.stage.prompts",
            )
        )
    return out
