"""What a run writes at the end besides the adapter: generation config, plots, stability report, model card."""

from __future__ import annotations

from hf_stable.logging import get_logger
from hf_stable.outputs import OutputDir

logger = get_logger("outputs")


def optimizer_markdown(table: list[dict]) -> str:
    if not table:
        return ""
    rows = ["| group | tensors | parameters | lr | weight decay |", "|---|---:|---:|---:|---:|"]
    for r in table:
        rows.append(f"| {r['name']} | {r['tensors']} | {r['parameters']:,} | {r['lr']:.3g} | {r['weight_decay']:g} |")
    return "\n".join(rows)


def quantization_markdown(cfg) -> str:
    """How the base was loaded when it was quantized (QLoRA), and how to merge the adapter: `hf-stable export`."""
    q = cfg.model.quantization
    if not q.enabled:
        return ""
    what = (
        f"4-bit {q.quant_type.upper()} ({'with' if q.double_quant else 'without'} double quantization, "
        f"compute dtype {q.compute_dtype})"
        if q.load_in == "4bit"
        else "8-bit (LLM.int8)"
    )
    return (
        f"The base was loaded in {what} through bitsandbytes (QLoRA); only the adapter was trained and saved. "
        "The adapter was trained against the dequantized 4-bit weights: `hf-stable export` merges it into those "
        "(not into the 16-bit base, which the adapter never saw; `merge_and_unload` on the quantized model would "
        "round the update away) and verifies the merged checkpoint against the trained model:"
    )


def finalize_outputs(output: OutputDir, cfg, trainer, summary: dict, *, data=None, optimizer_table=None) -> list[str]:
    """Write the generation config, the loss/LR plot, the stability report and the model card into the output dir,
    and put the stability verdict (`hf_stable.reporting.verdict`) into `summary["stability"]`.

    Nothing here may turn a finished (perhaps rescued) run into a crash: each part that fails is logged in one line
    and listed in the returned problems (also `summary["end_of_run_problems"]`), and the caller still writes
    run_summary.json."""
    from hf_stable.embeddings import repair_markdown
    from hf_stable.export.card import export_markdown
    from hf_stable.reporting.generation_config import save_generation_config
    from hf_stable.reporting.model_card import write_model_card
    from hf_stable.reporting.plots import plot_loss_lr
    from hf_stable.reporting.report import render_report
    from hf_stable.reporting.verdict import run_verdict, verdict_markdown

    problems: list[str] = []

    def attempt(what: str, fn, default=None):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported in one line; the run's weights are already saved
            problems.append(f"{what} failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
            logger.error("end of run: %s; the run itself finished and its summary is still written", problems[-1])
            return default

    history = trainer.state.log_history
    lr = getattr(getattr(trainer, "args", None), "learning_rate", None)
    stability = attempt("the stability verdict", lambda: run_verdict(output.path, history, lr))
    if stability is not None:
        summary["stability"] = stability
    tokenizer = getattr(trainer, "processing_class", None)
    stops = getattr(data, "stop_token_ids", None) or []
    if tokenizer is not None and data is not None:
        attempt("the generation config", lambda: save_generation_config(output.path, trainer.model, tokenizer, stops))

    plot = attempt(
        "the loss/LR plot",
        lambda: plot_loss_lr(history, output.path / "plots" / "loss_lr.png", title="loss and learning rate"),
    )
    data_md = ""
    if data is not None and getattr(data, "audit", None):
        from hf_stable.data.audit import audit_markdown

        data_md = attempt("the data audit section", lambda: audit_markdown(data.audit), "")
    doctor_md = output.path / "doctor_report.md"
    report_md = attempt("the stability report", lambda: render_report(output.path), "")
    verdict_md = attempt("the verdict section", lambda: verdict_markdown(stability), "")
    attempt(
        "the model card",
        lambda: write_model_card(
            output.path,
            config=cfg.to_dict(),
            summary=summary,
            base_model=cfg.model.name_or_path,
            plot_path="plots/loss_lr.png" if plot else None,
            data_section=data_md,
            optimizer_section=optimizer_markdown(optimizer_table or []),
            stability_section="\n\n".join(part for part in (verdict_md, report_md) if part),
            doctor_section=doctor_md.read_text(encoding="utf-8") if doctor_md.is_file() else "",
            quantization_section=quantization_markdown(cfg),
            export_section=export_markdown(summary.get("export")),
            tokens_section=repair_markdown(summary.get("untrained_tokens")),
            stop_tokens=tokenizer.convert_ids_to_tokens(stops) if tokenizer is not None and stops else None,
        ),
    )
    if problems:
        summary["end_of_run_problems"] = problems
    return problems
