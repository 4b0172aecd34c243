"""`stage: grpo`: TRL's GRPOTrainer under `hf_stable.stabilize`, on the SFT run's adapter (`model.start_from`),
with the rewards the recipe names and the prompts rendered as SFT rendered them.

Before and after training the stage measures greedy exact match per task family on held-out prompts (the SFT eval
set for the embedded prompts), so run_summary.json says what the stage gained over the adapter it started from,
next to the reward and KL over the steps (TRL's logs).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from hf_stable.logging import get_logger, is_main_process, print_main

logger = get_logger(__name__)

_INTERNAL = ("_where",)


def _data(cfg, seed: int):
    """(train prompt records, held-out records): `data.eval_file` auto is the embedded eval set for embedded
    prompts, a seeded split of the prompts for your own; null: no held-out evaluation."""
    from hf_stable.data.holdout import resolve_eval_file
    from hf_stable.stages.prompts import read_prompts, split_prompts

    rows = read_prompts(cfg.data.train_file, on_bad_record=cfg.data.on_bad_record, clean=cfg.data.clean)
    eval_file = resolve_eval_file(cfg.data.train_file, cfg.data.eval_file)
    if eval_file is None:
        return rows, []
    if eval_file == "auto":
        return split_prompts(rows, cfg.data.eval_max_records, seed)
    held = read_prompts(
        eval_file, on_bad_record=cfg.data.on_bad_record, clean=cfg.data.clean, config_field="data.eval_file"
    )
    return rows, held


def _prompt_text(tokenizer, record: dict, template: str) -> str:
    """The rendered prompt, without a BOS the tokenizer adds again (TRL tokenizes the text with special tokens)."""
    from hf_stable.stages.prompts import render_prompt

    text = render_prompt(tokenizer, record, template)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        ids = tokenizer(text=text)["input_ids"]
        if len(ids) > 1 and ids[0] == ids[1] == tokenizer.bos_token_id:
            text = text[len(bos) :]
    return text


def _dataset(tokenizer, rows: list[dict], template: str):
    from datasets import Dataset

    out = []
    for r in rows:
        row = {k: v for k, v in r.items() if k not in _INTERNAL and k != "messages"}
        row["prompt"] = _prompt_text(tokenizer, r, template)
        out.append(row)
    return Dataset.from_list(out)


def _encoder(tokenizer, template: str):
    return lambda r: tokenizer(text=_prompt_text(tokenizer, r, template))["input_ids"]


def exact_match_by_family(model, tokenizer, rows, template, stops, eval_cfg) -> dict | None:
    """Greedy exact match on up to `evaluation.exact_match_samples` held-out records (main process; None when there
    are none): the overall share and `by_family`."""
    from hf_stable.evaluation import exact_match
    from hf_stable.stages.prompts import reference

    n = min(eval_cfg.exact_match_samples, len(rows))
    if not n or not is_main_process():
        return None
    return exact_match(
        model,
        tokenizer,
        rows[:n],
        _encoder(tokenizer, template),
        reference,
        max_new_tokens=eval_cfg.max_new_tokens,
        batch_size=eval_cfg.generation_batch_size,
        stop_token_ids=stops,
    )


def _reference_data(tokenizer, rows, template, stops):
    """What the export's reference recording reads (`hf_stable.export.reference`): prompt + answer samples of the
    held-out records, labels on the answer and its end token."""
    from hf_stable.stages.prompts import reference

    samples = []
    for r in rows[:64]:
        prompt = tokenizer(text=_prompt_text(tokenizer, r, template))["input_ids"]
        answer = tokenizer(reference(r), add_special_tokens=False)["input_ids"] + [stops[0]]
        samples.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return SimpleNamespace(eval_dataset=samples, train_dataset=samples, stop_token_ids=stops)


def _series(history: list[dict], key: str) -> list[tuple[int, float]]:
    return [(h["step"], float(h[key])) for h in history if key in h and "step" in h]


def _window_mean(points: list[tuple[int, float]], first: bool) -> float | None:
    if not points:
        return None
    k = max(1, len(points) // 5)  # the first / last fifth of the logged steps
    part = points[:k] if first else points[-k:]
    return round(sum(v for _, v in part) / len(part), 4)


def stage_metrics(history: list[dict], before: dict | None, after: dict | None) -> dict:
    """The stage's numbers for run_summary.json: reward (first / last fifth of the logged steps, and every logged
    step), KL, exact match overall and per family before and after."""
    reward = _series(history, "reward")
    kl = _series(history, "kl")
    return {
        "reward_before": _window_mean(reward, first=True),
        "reward_after": _window_mean(reward, first=False),
        "reward_over_steps": [[s, round(v, 4)] for s, v in reward],
        "kl_first": kl[0][1] if kl else None,
        "kl_last": kl[-1][1] if kl else None,
        "kl_max": max(v for _, v in kl) if kl else None,
        "exact_match_before": (before or {}).get("exact_match"),
        "exact_match_after": (after or {}).get("exact_match"),
        "exact_match_by_family": {
            "before": (before or {}).get("by_family"),
            "after": (after or {}).get("by_family"),
        },
    }


def _family_line(metrics: dict) -> str:
    before = metrics["exact_match_by_family"]["before"] or {}
    after = metrics["exact_match_by_family"]["after"] or {}
    parts = [f"{f} {before.get(f, 0):.3f} -> {after.get(f, 0):.3f}" for f in sorted(set(before) | set(after))]
    return "exact match per family: " + (", ".join(parts) if parts else "not measured")


def run(cfg, started: float) -> dict:
    """Train the GRPO stage and write its outputs; returns the run summary."""
    import hf_stable
    from hf_stable.callbacks.preemption_callback import exit_if_preempted, stop_on_signals
    from hf_stable.data.prompts import resolve_template, stop_token_ids
    from hf_stable.distributed import shutdown
    from hf_stable.export.reference import record_after_training
    from hf_stable.modeling import count_parameters
    from hf_stable.outputs import error_boundary
    from hf_stable.rewards import resolve_rewards
    from hf_stable.stages.common import begin_stage, chain_text, save_stage_outputs
    from hf_stable.stages.start import load_stage_model

    setup = begin_stage(cfg)
    args, output = setup.args, setup.output
    with error_boundary(output), stop_on_signals(cfg.runtime.preemption, output):
        output.start(cfg.to_dict())
        rewards = resolve_rewards(cfg.rewards)
        model, tokenizer, base = load_stage_model(cfg, args, setup.start)
        template = resolve_template(tokenizer, cfg.data.template)
        stops = stop_token_ids(tokenizer, template)
        # completions end where SFT taught answers to end (the template's end of turn), as TRL reads it from the model
        (model.get_base_model() if hasattr(model, "get_base_model") else model).generation_config.eos_token_id = stops
        train_rows, eval_rows = _data(cfg, args.seed)
        dataset = _dataset(tokenizer, train_rows, template)
        n_trainable, n_total = count_parameters(model)
        logger.info(
            "stage grpo: %s, %d prompts, rewards %s, %d trainable of %d parameters",
            chain_text(setup.chain, cfg.model.name_or_path),
            len(dataset),
            ", ".join(cfg.rewards),
            n_trainable,
            n_total,
        )
        before = exact_match_by_family(model, tokenizer, eval_rows, template, stops, cfg.evaluation)

        from trl import GRPOTrainer

        trainer = GRPOTrainer(
            model=model, reward_funcs=rewards, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        hf_stable.stabilize(trainer, cfg)
        train_result = trainer.train()
        exit_if_preempted(trainer, output)
        after = exact_match_by_family(trainer.model, tokenizer, eval_rows, template, stops, cfg.evaluation)

        if eval_rows:
            record_after_training(
                trainer.model,
                tokenizer,
                _reference_data(tokenizer, eval_rows, template, stops),
                cfg,
                args.output_dir,
                base,
            )
        metrics = stage_metrics(trainer.state.log_history, before, after)
        summary = {
            "base_model": cfg.model.name_or_path,
            "start_from": cfg.model.start_from,
            "rewards": list(cfg.rewards),
            **metrics,
            "exact_match_detail": {"before": before, "after": after},
            "train_steps": trainer.state.global_step,
            "train_loss": train_result.training_loss,
            "wall_seconds": round(time.time() - started, 1),
            "n_trainable_parameters": n_trainable,
            "n_parameters": n_total,
        }
        summary = save_stage_outputs(cfg, setup, trainer, tokenizer, summary, stop_token_ids=stops)
        shutdown()
        print_main(
            f"\ndone in {summary['wall_seconds']}s, {summary['train_steps']} GRPO steps "
            f"({chain_text(setup.chain)}): reward {metrics['reward_before']} -> {metrics['reward_after']}, "
            f"{_family_line(metrics)}\noutput: {args.output_dir}"
        )
    return summary
