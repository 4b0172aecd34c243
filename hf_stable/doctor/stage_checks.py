"""Doctor checks for the stages after SFT (`stage: dpo | grpo`): settings TRL accepts that make the stage learn
nothing, or that cannot run, found before any step.

* reference: ``sync_ref_model`` with ``ref_model_mixup_alpha`` 1 copies the policy into the reference at every sync,
  so from the first sync the DPO rewards and the GRPO KL compare the policy with itself (error); DPO with ``beta`` 0
  makes every pair's sigmoid loss ln 2 whatever the model does: no gradient (error); GRPO with ``beta`` 0 loads no
  reference at all, so reference settings (``sync_ref_model``) do nothing (warning).
* generation (GRPO): the longest rendered prompt plus ``max_completion_length`` must fit the model's positions and,
  with ``use_vllm``, ``vllm_max_model_length`` (errors); beyond ``data.max_length`` it runs, but the memory
  estimate and the recipe's sequence budget assume ``data.max_length`` (warning).
* rewards (GRPO): each name in ``rewards:`` must import (`hf_stable.rewards.resolve_reward`) and return one number
  (or None) per completion when called as TRL calls it, on two completions of the first prompt (errors).
* memory: what a stage holds beyond the SFT estimate: the reference (a frozen copy of the adapter when an adapter is
  continued; a whole model copy without LoRA), DPO's chosen + rejected rows (each micro-batch row is two
  sequences), GRPO's generation KV cache (`stage_memory_parts`, added by `memory_estimate.memory_findings`).
"""

from __future__ import annotations

from hf_stable.doctor.findings import Finding

STAGE_DEFAULTS = {  # TRL 1.16's own defaults for the fields read here
    "dpo": {"beta": 0.1, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6},
    "grpo": {"beta": 0.0, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6, "max_completion_length": 512},
}


def _f(severity: str, name: str, what: str, evidence: str = "", fix: str = "") -> Finding:
    return Finding(severity, what, evidence, fix, check=f"hazards.stages.{name}")


def stage_value(cfg, key: str):
    """`key` of the running stage's section, or TRL's default."""
    section = getattr(cfg, cfg.stage, None) or {}
    return section.get(key, STAGE_DEFAULTS.get(cfg.stage, {}).get(key))


def check_reference(cfg) -> list[Finding]:
    """The reference model: equal to the policy where it must not be, or asked for while `beta` turns it off."""
    stage = cfg.stage
    beta = float(stage_value(cfg, "beta") or 0.0)
    sync, alpha = bool(stage_value(cfg, "sync_ref_model")), float(stage_value(cfg, "ref_model_mixup_alpha") or 0.0)
    out = []
    if stage == "dpo" and beta <= 0:
        out.append(
            _f(
                "error",
                "beta_zero",
                "dpo.beta is 0: every pair's loss is ln 2 whatever the model does, so DPO has no gradient",
                f"dpo.beta={beta:g} (DPO's reward is beta x the log-ratio to the reference)",
                "set dpo.beta > 0 (TRL's default 0.1)",
            )
        )
    if stage == "grpo" and beta == 0 and sync:
        out.append(
            _f(
                "warning",
                "beta_zero_reference",
                "grpo.beta is 0 but a reference is asked for (sync_ref_model): with beta 0 TRL loads no reference",
                "grpo.beta=0, grpo.sync_ref_model=true",
                "set grpo.beta > 0 for a KL penalty to the reference, or drop sync_ref_model",
            )
        )
    if sync and alpha >= 1.0 and (stage == "dpo" or beta > 0):
        what = "the DPO rewards" if stage == "dpo" else "the KL penalty"
        out.append(
            _f(
                "error",
                "reference_is_policy",
                f"{stage}.sync_ref_model with ref_model_mixup_alpha {alpha:g}: the reference becomes the policy at "
                f"every sync, so {what} compare the model with itself",
                f"{stage}.ref_model_sync_steps={stage_value(cfg, 'ref_model_sync_steps') or 512}",
                f"lower {stage}.ref_model_mixup_alpha (TRL's default 0.6) or set {stage}.sync_ref_model: false",
            )
        )
    return out


def _max_positions(model) -> int | None:
    """The model's `max_position_embeddings` (a real or meta-device model), None when unknown."""
    config = getattr(model, "config", None)
    n = getattr(config, "max_position_embeddings", None) if config is not None else None
    return int(n) if isinstance(n, int) and n > 0 else None


def check_generation_lengths(cfg, prompt_lengths: list[int], max_positions: int | None) -> list[Finding]:
    """GRPO: the longest prompt (tokens) + `max_completion_length` against what holds the sequence."""
    if cfg.stage != "grpo" or not prompt_lengths:
        return []
    longest, completion = max(prompt_lengths), int(stage_value(cfg, "max_completion_length") or 0)
    total = longest + completion
    evidence = f"longest prompt {longest} tokens + grpo.max_completion_length {completion} = {total}"
    fix = "lower grpo.max_completion_length, or shorten the prompts"
    out = []
    if max_positions is not None and total > max_positions:
        out.append(
            _f(
                "error",
                "generation_length",
                f"generation cannot fit the model's {max_positions} positions",
                evidence,
                fix,
            )
        )
    vllm_len = stage_value(cfg, "vllm_max_model_length")
    if stage_value(cfg, "use_vllm") and vllm_len and total > int(vllm_len):
        out.append(
            _f("error", "generation_length", f"generation cannot fit vllm_max_model_length {vllm_len}", evidence, fix)
        )
    if total > cfg.data.max_length:
        out.append(
            _f(
                "warning",
                "generation_length",
                f"prompt + completion can reach {total} tokens, beyond data.max_length {cfg.data.max_length}",
                evidence + "; the memory estimate assumes data.max_length",
                f"raise data.max_length to {total} or more, or {fix}",
            )
        )
    return out


def check_rewards(cfg, rows: list[dict] | None = None) -> list[Finding]:
    """GRPO: every reward in `rewards:` imports and returns one value per completion (called as TRL calls it)."""
    if cfg.stage != "grpo":
        return []
    from hf_stable.errors import ConfigError
    from hf_stable.rewards import resolve_reward

    row = dict((rows or [{}])[0])
    answer = str(row.get("answer", "1"))
    completions = [answer, answer + " x"]
    columns = {k: [v, v] for k, v in row.items() if k not in ("prompt", "messages", "_where")}
    out = []
    for name in cfg.rewards:
        try:
            fn = resolve_reward(name)
        except ConfigError as e:
            out.append(_f("error", "reward_import", f"reward {name!r} cannot be used", str(e), "fix rewards:"))
            continue
        try:
            got = fn(prompts=["?", "?"], completions=completions, completion_ids=[[0], [0]], **columns)
        except Exception as e:  # the user's function: named, in one line
            out.append(
                _f(
                    "error",
                    "reward_call",
                    f"reward {name!r} raised on a probe of 2 completions",
                    f"{type(e).__name__}: {e}",
                    "TRL calls fn(prompts=, completions=, completion_ids=, **dataset columns) -> list of floats",
                )
            )
            continue
        n = len(got) if isinstance(got, (list, tuple)) else None
        bad = n is None or any(not (v is None or isinstance(v, (int, float))) for v in got)
        if n != len(completions) or bad:
            out.append(
                _f(
                    "error",
                    "reward_length",
                    f"reward {name!r} must return one number (or None) per completion: got "
                    f"{type(got).__name__}{f' of {n}' if n is not None else ''} for {len(completions)} completions",
                    repr(got)[:120],
                    "return a list with one float per completion, in order",
                )
            )
    return out


def stage_memory_parts(cfg, s, *, h: int, layers: int, kv_heads: int, head_dim: int, weight_bytes: int) -> dict:
    """Bytes a stage holds beyond what an SFT step at the same settings holds (the caller adds them).

    Args:
        s: the doctor's `TrainingSettings`; h / layers / kv_heads / head_dim: the model's shape; weight_bytes: the
            trainable (adapter) bytes, or the whole model's bytes without LoRA.
    """
    stage = getattr(cfg, "stage", "sft")
    parts: dict[str, int] = {}
    if stage not in ("dpo", "grpo"):
        return parts
    act = 2 if (s.bf16 or s.fp16) else 4
    wants_reference = stage == "dpo" or float(stage_value(cfg, "beta") or 0.0) > 0
    # LoRA: TRL's frozen copy of a continued adapter (a fresh adapter is disabled instead: nothing extra); without
    # LoRA a whole second model
    if wants_reference and (not cfg.lora.enabled or cfg.model.start_from):
        parts["reference model" if not cfg.lora.enabled else "reference adapter copy"] = weight_bytes
    if stage == "grpo":
        completion = int(stage_value(cfg, "max_completion_length") or 0)
        rows = max(1, s.micro_batch)  # GRPO's batch counts completions
        length = int(cfg.data.max_length) + completion
        parts["generation KV cache"] = 2 * layers * kv_heads * head_dim * length * rows * act
    return parts


def _pair_findings(cfg, tokenizer) -> list[Finding]:
    """DPO data: the pair files read (without a tokenizer) or audited as the stage will tokenize them."""
    from hf_stable.data.pairs_bundle import resolve_pairs_eval

    files = [("train", cfg.data.train_file)]
    eval_file = resolve_pairs_eval(cfg.data.train_file, cfg.data.eval_file)
    if eval_file and eval_file != "auto":
        files.append(("eval", eval_file))
    out = []
    for name, path in files:
        key = f"data.{name}_file"
        try:
            if tokenizer is None:
                from hf_stable.data.pairs import read_pairs

                read = read_pairs(path, config_field=key, on_bad_record=cfg.data.on_bad_record, clean=False)
                out.append(_f("info", "data", f"{key}: {len(read.records)} preference pairs read", str(path)))
                continue
            from hf_stable.data.audit_pairs import audit_pairs

            a = audit_pairs(path, tokenizer, cfg.data, config_field=key)
        except Exception as e:  # a bad file is a finding, the other checks go on
            first, _, rest = str(e).partition("\n")
            out.append(_f("error", "data", f"{key} cannot be read as preference pairs", first, rest.strip()))
            continue
        out.append(_f("info", "data", f"{key}: {a['n_pairs']} preference pairs kept of {a['n_records']}", str(path)))
        out += [_f("warning", "data_audit", f"data audit ({name} pairs): {alert}", str(path)) for alert in a["alerts"]]
    return out


def _prompt_rows(cfg, tokenizer) -> tuple[list[dict], list[int], list[Finding]]:
    """GRPO prompts: the records and, with a tokenizer, their rendered lengths in tokens."""
    from hf_stable.data.prompts import resolve_template
    from hf_stable.stages.prompts import read_prompts, render_prompt

    try:
        rows = read_prompts(cfg.data.train_file, on_bad_record=cfg.data.on_bad_record, clean=False)
    except Exception as e:  # a bad file is a finding, the other checks go on
        return [], [], [_f("error", "data", "data.train_file cannot be read as GRPO prompts", str(e))]
    found = [_f("info", "data", f"data.train_file: {len(rows)} GRPO prompts read", str(cfg.data.train_file))]
    if tokenizer is None:
        return rows, [], found
    template = resolve_template(tokenizer, cfg.data.template)
    texts = [render_prompt(tokenizer, r, template) for r in rows]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return rows, lengths, found


def stage_findings(cfg, tokenizer=None, model=None) -> list[Finding]:
    """Every stage check for `cfg.stage` (none for SFT); checks whose inputs are missing are skipped."""
    if getattr(cfg, "stage", "sft") == "sft":
        return []
    out = check_reference(cfg)
    if tokenizer is not None:  # the stage's start, and GRPO's prompts, rewards and lengths (`hf_stable.stages.doctor`)
        from hf_stable.stages.doctor import stage_findings as start_and_prompt_findings

        out += start_and_prompt_findings(cfg, tokenizer)
    if cfg.stage == "dpo":
        return out + _pair_findings(cfg, tokenizer)
    # GRPO: the prompts, rewards and data.max_length are `hf_stable.stages.doctor`'s; here what must fit the model
    _, lengths, _ = _prompt_rows(cfg, tokenizer)
    return out + [f for f in check_generation_lengths(cfg, lengths, _max_positions(model)) if f.severity == "error"]
