"""The Hub-style model card (README.md) written into every run's output dir.

Metadata via `huggingface_hub.ModelCardData`; the body is rendered from the packaged template (`model_cards/template.md`
in the checkout), with sections other parts of hf_stable contribute (data audit, optimizer groups, stability report).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from hf_stable.embeddings.repair import REPAIR_FILE
from hf_stable.resources import embedded_dataset_name, package_file

TEMPLATE = package_file("templates", "model_card.md")  # `model_cards/template.md` in the checkout links to it


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _adapter_base(output_dir) -> str | None:
    """Where the adapter's base really is (for an embedded base: its cache dir)."""
    import json

    path = Path(output_dir) / "adapter_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("base_model_name_or_path")


def _versions() -> str:
    import importlib.metadata as md

    from hf_stable import __version__

    # ours from the code that runs (an editable install's metadata can lag behind it), the rest from their metadata
    rows = [f"- hf-stable {__version__}"]
    for pkg in ("torch", "transformers", "peft", "accelerate", "datasets"):
        try:
            rows.append(f"- {pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            pass
    return "\n".join(rows)


def write_model_card(
    output_dir: str | Path,
    *,
    config: dict,
    summary: dict,
    base_model: str,
    plot_path: str | None = None,
    data_section: str = "",
    optimizer_section: str = "",
    stability_section: str = "",
    doctor_section: str = "",
    quantization_section: str = "",
    export_section: str = "",
    tokens_section: str = "",
    tags: list[str] | None = None,
    stop_tokens: list[str] | None = None,
) -> Path:
    """Render README.md into `output_dir` and return its path (`stop_tokens`: what the saved generation config stops
    at, named in the card's Use section; `export_section`: the merged export and its verification, when made;
    `tokens_section`: untrained template-token rows repaired or trained, which the Use section must mention)."""
    from huggingface_hub import ModelCard, ModelCardData

    data_cfg = config.get("data", {})
    train = data_cfg.get("train_file")
    # named by its directory (`data/embedded/train.jsonl` -> embedded); the packaged `embedded:train` likewise
    name = "embedded" if embedded_dataset_name(train) else train and (Path(train).parent.name or train)
    datasets = [name] if name else []
    card_data = ModelCardData(
        base_model=base_model,
        library_name="peft",
        pipeline_tag="text-generation",
        tags=[
            "hf_stable",
            "lora",
            "peft",
            "text-generation",
            *(["qlora"] if quantization_section else []),
            *(tags or []),
        ],
        datasets=datasets,
    )
    card = ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        model_name=Path(output_dir).name,
        base_model=base_model,
        base_model_path=_adapter_base(output_dir) or base_model,
        eval_loss_before=_fmt(summary.get("eval_loss_before")),
        eval_loss_after=_fmt(summary.get("eval_loss_after")),
        exact_match_before=_fmt(summary.get("exact_match_before"), 3),
        exact_match_after=_fmt(summary.get("exact_match_after"), 3),
        train_steps=summary.get("train_steps"),
        wall_seconds=_fmt(summary.get("wall_seconds"), 1),
        n_trainable=f"{summary.get('n_trainable_parameters', 0):,}",
        n_total=f"{summary.get('n_parameters', 0):,}",
        plot_path=plot_path,
        train_file=data_cfg.get("train_file"),
        eval_file=summary.get("eval_source") or data_cfg.get("eval_file") or "none",
        data_section=data_section or "No data audit was run.",
        optimizer_section=optimizer_section,
        stability_section=stability_section or "No stability events were recorded.",
        doctor_section=doctor_section,
        quantization_section=quantization_section,
        export_section=export_section,
        tokens_section=tokens_section,
        repaired_rows=(Path(output_dir) / REPAIR_FILE).is_file(),
        stop_tokens=", ".join(f"`{t}`" for t in stop_tokens or []),
        config_yaml=yaml.safe_dump(config, sort_keys=False, allow_unicode=True).strip(),
        versions=_versions(),
    )
    path = Path(output_dir) / "README.md"
    card.save(path)
    return path
