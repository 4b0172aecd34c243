"""The merged checkpoint's model card, and the export section of the run's own card."""

from __future__ import annotations

from pathlib import Path

from hf_stable.resources import package_file

TEMPLATE = package_file("templates", "merged_model_card.md")


def verification_markdown(check: dict | None) -> str:
    """The verification numbers as a short table (what export_check.json holds), or why there are none."""
    if not check:
        return "Not verified."
    tol = check.get("tolerances", {})
    n_eq, n = check.get("generations_equal"), check.get("generations_total")
    rows = [
        "| measure | value | tolerance |",
        "|---|---:|---:|",
        f"| max \\|Δlogit\\| (top-{check.get('top_k')}, {check.get('n_answer_positions')} answer positions) "
        + f"| {check.get('max_abs_logit_diff', float('nan')):.3g} | {tol.get('max_abs_logit_diff', '—')} |",
        f"| mean KL(trained ‖ merged), nats | {check.get('mean_kl', float('nan')):.3g} | {tol.get('mean_kl', '—')} |",
        f"| top-1 agreement | {check.get('top1_agreement', float('nan')):.4f} | |",
        f"| greedy generations equal | {n_eq} of {n} | " + f"≥ {1 - tol.get('generation_mismatch_fraction', 0):.0%} |",
    ]
    fingerprint = check.get("base_fingerprint")
    text = (
        f"Checked in a fresh process that loaded this directory with transformers alone ({check.get('dtype')}), on "
        f"{check.get('n_prompts')} held-out prompts ({check.get('reference_source')} records) against the logits and "
        f"greedy generations the trained model (base + adapter, {check.get('reference_dtype')}) recorded at the end of "
        "training:\n\n" + "\n".join(rows)
    )
    if fingerprint:
        text += f"\n\nBase weights fingerprint (sampled SHA-256): `{fingerprint[:16]}…`, the one training used."
    q = check.get("qlora")
    if q:
        text += (
            f"\n\nQLoRA: merged into the {q['merged_into']} base weights (dequantized: the 4-bit weights the adapter trained "
            "against; original: the 16-bit checkpoint). Between merges into the dequantized 4-bit and the "
            f"original 16-bit weights the logits differ by mean |Δ| {q['mean_abs_logit_diff']:.3g}, max |Δ| "
            f"{q['max_abs_logit_diff']:.3g} on the same answer positions."
        )
    if check.get("numbers_judged") is False:
        text += (
            "\n\nThe logit and generation numbers are reported, not judged: this export is not the model as trained."
        )
    text += f"\n\nResult: **{'passed' if check.get('passed') else 'FAILED'}**"
    if check.get("problems"):
        text += " — " + "; ".join(check["problems"])
    return text


def export_markdown(summary: dict | None) -> str:
    """The run card's "Merged export" section from the summary's `export` entry (empty when none was made)."""
    if not summary:
        return ""
    return f"Merged checkpoint in `{summary.get('dir')}` ({summary.get('dtype')}).\n\n" + verification_markdown(
        summary.get("check")
    )


def write_merged_card(out: Path, *, base_model: str, run_dir: Path, dtype: str, merge_text: str, check, stop_tokens):
    """Render README.md into the merged directory."""
    from huggingface_hub import ModelCard, ModelCardData

    from hf_stable.reporting.model_card import _versions

    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["hf_stable", "merged-lora", "text-generation"],
    )
    card = ModelCard.from_template(
        data,
        template_path=str(TEMPLATE),
        model_name=out.name,
        base_model=base_model,
        run_dir=str(run_dir),
        dtype=dtype,
        merge_text=merge_text,
        verification=verification_markdown(check),
        stop_tokens=", ".join(f"`{t}`" for t in stop_tokens or []),
        versions=_versions(),
    )
    card.save(out / "README.md")
