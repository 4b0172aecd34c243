"""LoRA fine-tuning recipe: config → model → data → optimizer → callbacks → Trainer → adapter + model card.

    accelerate launch scripts/finetune.py                                   # embedded default (CPU, offline)
    accelerate launch scripts/finetune.py --config configs/qwen2.5-7b-lora.yaml --training.learning_rate 1e-4
    accelerate launch scripts/finetune.py --config configs/grpo.yaml          # GRPO from the default SFT run's adapter

Every step below is one call into hf_stable; the library holds the logic, this file holds the order.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# hf_stable first: it quiets bitsandbytes' "pip install kernels" notice before transformers imports bitsandbytes
import hf_stable  # noqa: F401, I001
from transformers import set_seed

from hf_stable.callbacks import build_callbacks
from hf_stable.callbacks.before_training_evaluation import BeforeTrainingEvaluation
from hf_stable.callbacks.guards import guard_training_overrides
from hf_stable.callbacks.preemption_callback import exit_if_preempted, stop_on_signals
from hf_stable.checkpoints import resolve_resume
from hf_stable.config import load_config, training_arguments
from hf_stable.data import build_data
from hf_stable.distributed import prepare_launch, shutdown
from hf_stable.doctor import preflight
from hf_stable.doctor.quick_checks import warn_quick_checks
from hf_stable.embeddings import handle_untrained_tokens, save_repair, trainable_token_indices
from hf_stable.evaluation import evaluate_run, results_line
from hf_stable.export.exporter import export_after_training
from hf_stable.export.reference import record_after_training
from hf_stable.first_screen import quiet_first_screen
from hf_stable.logging import get_logger, is_main_process, print_main
from hf_stable.modeling import apply_lora, count_parameters, load_model, load_tokenizer, resolve_base
from hf_stable.optim import build_optimizer, format_group_table, group_table, trainer_optimizer_arguments
from hf_stable.optim.phases import wrap_for_phases
from hf_stable.outputs import OutputDir, error_boundary
from hf_stable.reporting import finalize_outputs, save_generation_config
from hf_stable.reporting.verdict import verdict_line
from hf_stable.stages import run_stage
from hf_stable.trainer import StableTrainer

logger = get_logger("finetune")


def main(argv: list[str]) -> None:
    started = time.time()
    with error_boundary():
        cfg = load_config(argv=argv)
        if cfg.stage != "sft":  # dpo / grpo: TRL's trainer under hf_stable.stabilize (hf_stable/stages)
            run_stage(cfg, started)
            return
        quiet_first_screen(cfg)  # other libraries' notices that are wrong for this run (DeepSpeed's CPU line, ...)
        # an embedded base is built (ranks share one build through a file lock) before TrainingArguments: with a ZeRO-3
        # config every model construction after them is a collective that a rank building alone would hang in
        if cfg.model.is_embedded:
            resolve_base(cfg.model)
        # hf_stable owns clipping (max_grad_norm=0) and, for batch warmup / thermal, gradient accumulation
        args = training_arguments(
            cfg, remove_unused_columns=False, **guard_training_overrides(cfg.stability.guards, cfg.training)
        )
        prepare_launch(args)  # e.g. refuses N processes that would each train alone on CPU
    output = OutputDir(args.output_dir, overwrite=cfg.runtime.overwrite)  # a finished run: refused or moved aside
    # a SIGTERM outside a training step (nothing to save) marks the run "preempted" and exits 143
    with error_boundary(output), stop_on_signals(cfg.runtime.preemption, output):
        output.start(cfg.to_dict())
        logger.info("config %s -> output dir %s", cfg.source, args.output_dir)
        if (
            not cfg.doctor
        ):  # the doctor's config checks that need no dry run, one WARNING line each (preflight repeats)
            warn_quick_checks(cfg, args)

        resume = resolve_resume(cfg.runtime.resume, args)  # newest *complete* checkpoint, same on every rank
        output.set_aside_events(resuming=resume is not None)  # a fresh run reports only its own events

        # 1. base model, tokenizer
        base = resolve_base(cfg.model)  # a directory or Hub id (an embedded base is built by now)
        tokenizer = load_tokenizer(cfg.model, base)
        model = load_model(cfg, base)

        # 2. data: load, clean, tokenize, audit
        data = build_data(
            cfg.data,
            tokenizer,
            seed=args.seed,
            output_dir=args.output_dir,
            batch_size=args.per_device_train_batch_size,
            vocab_size=model.get_input_embeddings().num_embeddings,
            torch_compile=args.torch_compile,  # shape buckets (data.shape_buckets) bound the compilations
        )

        # 2a. template tokens the data uses whose base rows are untrained: repaired (or trained) before LoRA freezes
        # them, since LoRA cannot change an embedding row; then LoRA
        untrained = handle_untrained_tokens(model, tokenizer, data, cfg.model.untrained_tokens)
        set_seed(args.seed)  # LoRA's random init must not depend on the process or the run
        model = apply_lora(
            model,
            cfg.lora,
            args.gradient_checkpointing,
            quantization=cfg.model.quantization,
            trainable_tokens=trainable_token_indices(model, untrained),
        )
        n_trainable, n_total = count_parameters(model)
        logger.info("model %s: %d trainable of %d parameters", cfg.model.name_or_path, n_trainable, n_total)

        # 2b. preflight doctor (environment, config hazards, dry run with weights restored): refuses on a blocker
        if cfg.doctor:
            preflight(cfg, args, model=model, tokenizer=tokenizer, data=data, untrained=untrained)

        # 3. optimizer groups (layer-wise LR, no-decay groups, LoRA+)
        phases = cfg.stability.guards.phases if cfg.stability.guards.enabled else None
        optimizer = build_optimizer(model, cfg.optim, args)
        if phases is not None and phases.enabled:
            optimizer = wrap_for_phases(optimizer, phases, cfg.optim, args)
        table = group_table(optimizer)
        output.write_json("optimizer_groups.json", table)
        print_main(format_group_table(table))

        # 4. stability callbacks (monitors, guards, spike forensics, preemption, checkpoint marker, one-line printer
        # with disable_tqdm) and the Trainer (its grad norm comes from the monitors' one pass over the gradients);
        # under DeepSpeed and FSDP the Trainer builds the same optimizer groups itself (it drops or refuses a prebuilt one)
        callbacks = build_callbacks(cfg, args, records=data.records)
        trainer = StableTrainer(
            model=model,
            args=args,
            train_dataset=data.train_dataset,
            eval_dataset=data.eval_dataset,
            data_collator=data.collator,
            processing_class=tokenizer,
            callbacks=callbacks,
            training_loss=cfg.training_loss,  # chunked LM head + cross-entropy: the logits are never held whole
            **trainer_optimizer_arguments(optimizer, cfg.optim, args, phases=phases),
        )

        # 5. evaluate, train, evaluate. The evaluation before training runs as training begins, once the engine
        # (DeepSpeed, FSDP) has prepared the model; a resumed run keeps its first launch's numbers
        before = BeforeTrainingEvaluation(trainer, tokenizer, data, cfg.evaluation) if cfg.evaluation.before else None
        if before is not None:
            trainer.add_callback(before)  # last: every other callback has begun when it evaluates
        train_result = trainer.train(resume_from_checkpoint=resume)
        exit_if_preempted(trainer, output)  # SIGTERM: checkpoint saved, exit 143, run marked "preempted"
        after = evaluate_run(trainer, tokenizer, data, cfg.evaluation, prefix="after")
        before = before.result if before is not None else {}

        # 6. adapter, tokenizer, generation config, repaired base rows, state; the reference a merged export is verified against (the
        # trained model's answer logits and greedy generations on held-out prompts); the merged export when asked
        # (rank 0, the others wait; a failed export is a failed run); plots, model card, summary
        trainer.save_model(args.output_dir)
        trainer.save_state()
        if is_main_process():
            tokenizer.save_pretrained(args.output_dir)
            save_generation_config(args.output_dir, trainer.model, tokenizer, data.stop_token_ids)
            if cfg.lora.enabled:  # the repaired base rows the adapter was trained on (a full fine-tune saved them)
                save_repair(args.output_dir, untrained)
        record_after_training(trainer.model, tokenizer, data, cfg, args.output_dir, base)
        exported = export_after_training(cfg, args.output_dir)
        summary = {
            "base_model": cfg.model.name_or_path,
            "eval_source": data.eval_source,  # the eval file, or the records held out of the train file
            "eval_loss_before": before.get("eval_loss"),
            "eval_loss_after": after.get("eval_loss"),
            "exact_match_before": before.get("exact_match"),
            "exact_match_after": after.get("exact_match"),
            "train_steps": trainer.state.global_step,
            "train_loss": train_result.training_loss,
            "wall_seconds": round(time.time() - started, 1),
            "n_trainable_parameters": n_trainable,
            "n_parameters": n_total,
            "exact_match_detail": {
                "before": before.get("exact_match_detail"),
                "after": after.get("exact_match_detail"),
            },
        }
        if untrained.candidates:
            summary["untrained_tokens"] = untrained.to_dict()
        if exported is not None:
            summary["export"] = exported
        if is_main_process():
            finalize_outputs(output, cfg, trainer, summary, data=data, optimizer_table=table)
        output.finish(summary)
        shutdown()  # every rank leaves together
        print_main(
            f"\ndone in {summary['wall_seconds']}s, {summary['train_steps']} steps: {results_line(summary)}\n"
            f"output: {os.path.abspath(args.output_dir)}"
        )
        if verdict_line(
            summary.get("stability")
        ):  # a run that was not healthy says so last (docs/outputs-and-resume.md)
            print_main(verdict_line(summary["stability"]))


if __name__ == "__main__":
    main(sys.argv[1:])
