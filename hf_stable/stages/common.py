"""What every TRL stage shares: the arguments and output dir before training, the stage chain, and the outputs after
(adapter, tokenizer, run summary, model card naming the chain, the merged export when asked)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf_stable.logging import get_logger, is_main_process

logger = get_logger(__name__)

CHAIN_NAMES = {"sft": "SFT", "dpo": "DPO", "grpo": "GRPO"}


@dataclass
class StageSetup:
    """A stage about to build its trainer: TRL's `args`, the `output` dir (started), where it starts (`start`,
    None: from the base) and the stage chain this run ends (`chain`: ['sft', 'grpo'])."""

    args: object
    output: object
    start: object
    chain: list[str]


def stage_chain(start, stage: str) -> list[str]:
    """The stages behind this run's weights, ending with `stage` (['sft', 'grpo'] from an SFT adapter)."""
    return [*(start.chain if start is not None and start.chain else []), stage]


def chain_text(chain: list[str], base: str = "base") -> str:
    """'base → SFT → GRPO'."""
    return " → ".join([base, *(CHAIN_NAMES.get(s, s.upper()) for s in chain)])


def begin_stage(cfg, **forced) -> StageSetup:
    """TRL's config for the stage (`stage_arguments` with the guards' overrides and `forced`), the launch checks,
    the output dir started with the resolved config, and `model.start_from` resolved. Every rank calls it."""
    from hf_stable.callbacks.guards import guard_training_overrides
    from hf_stable.config.stages import stage_arguments
    from hf_stable.distributed import prepare_launch
    from hf_stable.first_screen import quiet_first_screen
    from hf_stable.modeling import resolve_base
    from hf_stable.outputs import OutputDir
    from hf_stable.stages.start import resolve_start_from

    quiet_first_screen(cfg)
    start = resolve_start_from(cfg.model.start_from) if cfg.model.start_from else None
    if cfg.model.is_embedded and (start is None or start.kind == "adapter"):
        resolve_base(cfg.model)  # built once (ranks share it) before TRL's config, as the SFT recipe does
    forced = {"remove_unused_columns": False, **guard_training_overrides(cfg.stability.guards, cfg.training), **forced}
    args = stage_arguments(cfg, **forced)
    prepare_launch(args)
    output = OutputDir(args.output_dir, overwrite=cfg.runtime.overwrite)
    return StageSetup(args=args, output=output, start=start, chain=stage_chain(start, cfg.stage))


def add_chain_to_card(output_dir, chain: list[str], base_model: str) -> None:
    """Name the stage chain at the top of the run's model card (README.md), under its front matter."""
    path = Path(output_dir) / "README.md"
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8")
    line = f"**Stage chain:** {chain_text(chain, base_model)} (hf_stable `stage: {chain[-1]}`)\n\n"
    head, sep, body = text.partition("\n---\n") if text.startswith("---") else ("", "", text)
    path.write_text(f"{head}{sep}\n{line}{body.lstrip()}" if sep else line + body, encoding="utf-8")


def save_stage_outputs(cfg, setup: StageSetup, trainer, tokenizer, summary: dict, stop_token_ids=None) -> dict:
    """Adapter, state, tokenizer, generation config (stopping at `stop_token_ids`, default the EOS); the merged
    export when `export.merged`; plots, report, model card (naming the stage chain) and run_summary.json. Returns
    the summary as written."""
    from hf_stable.export.exporter import export_after_training
    from hf_stable.reporting import finalize_outputs, save_generation_config

    out = setup.args.output_dir
    trainer.save_model(out)
    trainer.save_state()
    if is_main_process():
        tokenizer.save_pretrained(out)
        save_generation_config(out, trainer.model, tokenizer, list(stop_token_ids or [tokenizer.eos_token_id]))
        if setup.start is not None and setup.start.kind == "adapter":
            _copy_repair(setup.start.path, out)
    summary = {"stage": cfg.stage, "stage_chain": setup.chain, **summary}
    exported = export_after_training(cfg, out)
    if exported is not None:
        summary["export"] = exported
    if is_main_process():
        finalize_outputs(setup.output, cfg, trainer, summary)
        add_chain_to_card(out, setup.chain, cfg.model.name_or_path)
    setup.output.finish(summary)
    return summary


def _copy_repair(src: Path, dst) -> None:
    """The SFT run's repaired base rows travel with the adapter trained further (export applies them)."""
    import shutil

    from hf_stable.embeddings.repair import REPAIR_FILE

    if (Path(src) / REPAIR_FILE).is_file():
        shutil.copy2(Path(src) / REPAIR_FILE, Path(dst) / REPAIR_FILE)
