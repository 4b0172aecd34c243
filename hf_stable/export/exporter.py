"""`export_run`: merge a finished run's adapter, save the standalone checkpoint, verify it, report.

The steps, each failing with one `ExportError` that names the file and the fix:
1. the run's config and reference (`export_reference.safetensors`, recorded at the end of training);
2. the base it trained on, found again (`resolve_base`), its weights' fingerprint compared with the reference's;
3. the merge (`hf_stable.export.merge`), saved in the asked dtype with tokenizer, chat template, generation config;
4. the verification in a fresh process that has only transformers (`python -m hf_stable.export.verify`), whose
   numbers go to `DIR/export_check.json` and the model card; beyond tolerance the export fails.

The recipe calls `export_after_training` (rank 0 exports, the other ranks wait for its verdict).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hf_stable.errors import ExportError, HfStableError
from hf_stable.export.fingerprint import base_directory, weights_fingerprint
from hf_stable.export.reference import REFERENCE_FILE
from hf_stable.logging import get_logger

logger = get_logger(__name__)

CHECK_FILE = "export_check.json"
VERIFY_TIMEOUT_SECONDS = 3600
_EXPORT_MARKERS = (CHECK_FILE, "config.json")


def _reference_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return json.loads(handle.metadata()["hf_stable_reference"])


def _prepare_out(out: Path, run_dir: Path) -> None:
    """An empty or new directory, or an earlier export (its weight files are removed: shards of another dtype would
    be read along with the new ones)."""
    if out.resolve() == run_dir.resolve():
        raise ExportError(f"--out {out}: that is the run directory itself; choose a subdirectory (default: merged)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: a file is in the way; remove it or choose another directory")
    if out.is_dir() and any(out.iterdir()):
        if not any((out / m).is_file() for m in _EXPORT_MARKERS):
            raise ExportError(
                f"--out {out}: exists, is not empty and holds no earlier export; choose another directory"
            )
        for f in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json"), out / CHECK_FILE]:
            f.unlink(missing_ok=True)


def _load_tokenizer(run_dir: Path, cfg):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # embedded bases: PreTrainedTokenizerFast, as training loaded it (AutoTokenizer may pick a model-specific class)
    loader = PreTrainedTokenizerFast if cfg.model.is_embedded else AutoTokenizer
    try:
        return loader.from_pretrained(str(run_dir), trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ExportError(f"{run_dir}: cannot load the run's tokenizer: {e}") from None


def _verify(out: Path, reference: Path, structure_only: bool = False) -> dict:
    """Run the verification in a fresh interpreter; its numbers, or an ExportError when it could not run."""
    import hf_stable

    root = str(Path(hf_stable.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    check_path = out / CHECK_FILE
    cmd = [sys.executable, "-m", "hf_stable.export.verify", str(out), "--reference", str(reference)]
    cmd += ["--structure-only"] if structure_only else []
    proc = subprocess.run(
        [*cmd, "--json", str(check_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_SECONDS,
        check=False,
    )
    if proc.returncode not in (0, 1) or not check_path.is_file():
        raise ExportError(
            f"{out}: the verification could not load or run the merged checkpoint with transformers (exit "
            f"{proc.returncode}): {proc.stderr.strip()[-1500:]}"
        )
    return json.loads(check_path.read_text(encoding="utf-8"))


def _qlora_difference(a, b, reference: Path) -> dict:
    """Mean / max |Δlogit| between two merged models on the reference's answer positions (full vocabulary)."""
    import torch

    from hf_stable.export.reference import answer_positions, read_reference

    _, samples, _ = read_reference(reference)
    diffs = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["input_ids"]])
            pos = torch.tensor(answer_positions(s["labels"]))
            diffs.append((a(input_ids=ids).logits[0, pos] - b(input_ids=ids).logits[0, pos]).abs().flatten())
    d = torch.cat(diffs)
    return {"mean_abs_logit_diff": d.mean().item(), "max_abs_logit_diff": d.max().item()}


def _merge_text(dtype: str, cfg, qlora_base: str | None, run_dir: Path | None = None) -> str:
    from hf_stable.embeddings import REPAIR_FILE, read_repair

    text = (
        "peft `merge_and_unload` in float32 (W + BA computed once), then one cast to "
        f"{dtype}; transformers' default attention and sharding."
    )
    saved = read_repair(run_dir) if run_dir is not None else None
    if saved and saved[0].get("tokens"):
        names = ", ".join(f"`{t}`" for t in saved[0]["tokens"])
        text += (
            f" Before the merge, the base rows of {names}, which the run found untrained and set to the mean of the "
            f"trained rows, were written into the base from the run's `{REPAIR_FILE}` (the adapter does not hold "
            "them): this checkpoint carries the repair."
        )
    if qlora_base:
        into = (
            "the dequantized 4-bit weights the adapter was trained against (the base loaded in 4 bits as training "
            "loaded it, each quantized Linear dequantized)"
            if qlora_base == "dequantized"
            else "the original 16-bit base weights (not the 4-bit ones the adapter was trained against)"
        )
        text += f" QLoRA run: merged into {into}."
    return text


def export_run(run_dir, out=None, dtype: str | None = None, qlora_base: str | None = None) -> dict:
    """Merge, save, verify. Returns {"dir", "dtype", "check"} (the check is also in DIR/export_check.json).

    Raises:
        ExportError: not a run dir, no reference, a changed base, a checkpoint transformers cannot load, or a
            verification beyond tolerance (the message names the numbers and the tolerances).
    """
    from hf_stable.export.card import write_merged_card
    from hf_stable.export.merge import dequantized_weights, load_merged, resolve_dtype, run_config, save_merged
    from hf_stable.modeling import resolve_base

    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    out = Path(out or cfg.export.out or run_dir / "merged")
    reference = run_dir / REFERENCE_FILE
    if not reference.is_file():
        raise ExportError(
            f"{run_dir}: no {REFERENCE_FILE} to verify the export against (the run had export.reference: false, "
            "trained with sharded parameters, or predates it); rerun training with export.reference: true"
        )
    meta = _reference_meta(reference)
    base = resolve_base(cfg.model)
    fingerprint = weights_fingerprint(base_directory(base, cfg.model.revision) or base)
    trained_on = (meta.get("base_fingerprint") or {}).get("sha256")
    if trained_on and fingerprint and fingerprint["sha256"] != trained_on:
        raise ExportError(
            f"model.name_or_path: the base found now ({base}) is not the one {run_dir} trained on (weights "
            f"fingerprint {fingerprint['sha256'][:16]} vs {trained_on[:16]} in {REFERENCE_FILE}); point "
            "model.name_or_path / model.revision in resolved_config.yaml at the base the run used"
        )
    dtype = resolve_dtype(dtype or cfg.export.dtype, base, cfg)
    q = cfg.model.quantization
    qlora = q.enabled and q.load_in == "4bit"
    qlora_base = (qlora_base or cfg.export.qlora_base) if qlora else None
    _prepare_out(out, run_dir)
    tokenizer = _load_tokenizer(run_dir, cfg)

    logger.info("export: merging %s into %s (%s) -> %s", run_dir, base, dtype, out)
    dequantized = dequantized_weights(cfg, base) if qlora else None
    merged = load_merged(run_dir, cfg, base, dequantized=dequantized if qlora_base == "dequantized" else None)
    qlora_info = None
    if qlora:
        other = load_merged(run_dir, cfg, base, dequantized=None if qlora_base == "dequantized" else dequantized)
        qlora_info = {"merged_into": qlora_base, **_qlora_difference(merged, other, reference)}
        del other
    save_merged(merged, out, dtype, run_dir, tokenizer)
    del merged

    # merged into the original 16-bit base on request: not the weights the adapter trained against, so its distance
    # from the trained model is the quantization error, reported (qlora) but not judged
    check = _verify(out, reference, structure_only=qlora_base == "original")
    check.update(
        run_dir=str(run_dir),
        base=str(base),
        base_fingerprint=fingerprint["sha256"] if fingerprint else None,
        qlora=qlora_info,
    )
    (out / CHECK_FILE).write_text(json.dumps(check, indent=2), encoding="utf-8")
    stops = tokenizer.convert_ids_to_tokens(check["stop_token_ids_expected"])
    write_merged_card(
        out,
        base_model=cfg.model.name_or_path,
        run_dir=run_dir,
        dtype=dtype,
        merge_text=_merge_text(dtype, cfg, qlora_base, run_dir),
        check=check,
        stop_tokens=stops,
    )
    if not check["passed"]:
        raise ExportError(
            f"{out}: the merged checkpoint does not reproduce the trained model ({dtype}): "
            + "; ".join(check["problems"])
            + f". Numbers in {out / CHECK_FILE}; tolerances per dtype are in docs/export.md"
        )
    return {"dir": str(out), "dtype": dtype, "check": check}


def export_after_training(cfg, output_dir) -> dict | None:
    """The recipe's export (`export.merged: true`): rank 0 exports and verifies, every rank gets its result.

    Raises:
        ExportError: on every rank when rank 0's export failed (a failed export is a failed run).
    """
    from hf_stable.distributed import broadcast_object
    from hf_stable.logging import is_main_process

    if not cfg.export.merged:
        return None
    result = failure = None
    if is_main_process():
        try:
            result = export_run(output_dir)
        except HfStableError as e:
            failure = str(e)
    result, failure = broadcast_object((result, failure))  # the other ranks wait here (training.ddp_timeout)
    if failure:
        raise ExportError(failure)
    check = {k: v for k, v in result["check"].items() if k != "generation_mismatches"}
    result = {**result, "check": check}
    logger.info(
        "export: %s (%s) verified: max |Δlogit| %.3g, mean KL %.3g, greedy generations equal %d/%d",
        result["dir"],
        result["dtype"],
        check["max_abs_logit_diff"],
        check["mean_kl"],
        check["generations_equal"],
        check["generations_total"],
    )
    return result
