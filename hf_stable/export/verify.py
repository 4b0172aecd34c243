"""Verify a merged checkpoint against the training reference, in a process that loads it with transformers alone.

    python -m hf_stable.export.verify MERGED_DIR --reference RUN_DIR/export_reference.safetensors --json CHECK.json

What vLLM / TGI / `pipeline()` read is what this loads: `AutoModelForCausalLM.from_pretrained(MERGED_DIR,
dtype="auto")` with the `generation_config.json` there; peft and hf_stable's model code are not imported (the check
records whether peft ended up in `sys.modules`). On the reference's held-out samples it measures:

* max |Δlogit| over the reference's top-k entries of every answer position;
* mean KL(trained || merged) over the answer positions, on the top-k tokens plus one bucket for the rest of the
  vocabulary (a lower bound of the full KL, tight when the top k hold nearly all the mass);
* greedy generations (batch of one, the checkpoint's generation config made greedy) compared token for token;
* that `generation_config.json` stops at every stop token the run trained answers to end with.

Tolerances (`TOLERANCES`, stated in docs/export.md; the coarser of the export's dtype and the trained model's applies):
in float32 the merged model must reproduce the trained one up to float rounding and generate the same tokens; in 16
bits each weight is rounded once (bf16 keeps 8 bits of mantissa), so logits move (0.01 on the tiny test models, more
on large ones) and near-ties may flip a greedy token: the flips are reported, up to a quarter of the prompts pass, and
only a KL or a logit change far beyond rounding fails. A tampered weight or another base moves the KL by orders of
magnitude more. Exit status 0 when every number is within tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# per merged dtype: max |Δlogit| on the top-k entries, mean KL (nats), fraction of prompts whose generation may differ
TOLERANCES = {
    "float32": {"max_abs_logit_diff": 1e-3, "mean_kl": 1e-6, "generation_mismatch_fraction": 0.0},
    "bfloat16": {"max_abs_logit_diff": 1.0, "mean_kl": 1e-2, "generation_mismatch_fraction": 0.25},
    "float16": {"max_abs_logit_diff": 0.5, "mean_kl": 5e-3, "generation_mismatch_fraction": 0.25},
}


def tolerance(dtype: str, reference_dtype: str) -> dict:
    """The tolerance of the coarser of the export's dtype and the dtype the trained model ran in (a bf16-trained
    reference cannot be matched to fp32 precision by a float32 export)."""
    names = [d for d in (dtype, reference_dtype) if d in TOLERANCES and d != "float32"]
    return TOLERANCES[max(names, key=lambda d: TOLERANCES[d]["mean_kl"]) if names else "float32"]


def kl_top_k(ref_values, ref_indices, ref_lse, logits):
    """Per position KL(p_ref || p_new) over the reference's top-k tokens plus one "rest of the vocabulary" bucket."""
    import torch

    p_ref = (ref_values - ref_lse[:, None]).exp()
    logp_new = torch.log_softmax(logits, dim=-1).gather(-1, ref_indices.long())
    p_new = logp_new.exp()
    tail_ref = (1 - p_ref.sum(-1)).clamp_min(0)
    tail_new = (1 - p_new.sum(-1)).clamp_min(1e-12)
    kl = (p_ref * ((ref_values - ref_lse[:, None]) - logp_new)).sum(-1)
    kl = kl + torch.where(tail_ref > 0, tail_ref * (tail_ref.clamp_min(1e-12).log() - tail_new.log()), 0.0)
    return kl.clamp_min(0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(model, reference_path, dtype: str | None = None) -> dict:
    """The verification numbers of `model` (loaded from the merged dir) against the reference file."""
    import torch

    from hf_stable.export.reference import answer_positions, greedy_config, read_reference

    meta, samples, ref = read_reference(reference_path)
    gen = greedy_config(model.generation_config, meta["max_new_tokens"])
    device = next(model.parameters()).device
    diffs, kls, top1 = [], [], []
    mismatches = []
    start = 0
    with torch.no_grad():
        for i, s in enumerate(samples):
            pos = answer_positions(s["labels"])
            ids = torch.tensor([s["input_ids"]], device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0, torch.tensor(pos, device=device)].float().cpu()
            rv = ref["topk_values"][start : start + len(pos)]
            ri = ref["topk_indices"][start : start + len(pos)]
            rl = ref["logsumexp"][start : start + len(pos)]
            start += len(pos)
            diffs.append((logits.gather(-1, ri.long()) - rv).abs().max().item())
            kls.append(kl_top_k(rv, ri, rl, logits))
            top1.append((logits.argmax(-1) == ri[:, 0].long()).float())
            n_prompt = next(j for j, label in enumerate(s["labels"]) if label != -100)
            prompt = ids[:, :n_prompt]
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=gen)
            generated = out[0, n_prompt:].tolist()
            where = first_difference(generated, s["generated"])
            if where is not None:
                mismatches.append(
                    {"prompt": i, "first_difference": where, "expected": s["generated"], "got": generated}
                )
    kl = torch.cat(kls)
    stops = [int(t) for t in meta["stop_token_ids"]]
    eos = model.generation_config.eos_token_id
    eos = [int(t) for t in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])]
    dtype = dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
    return {
        "dtype": dtype,
        "reference_dtype": meta["dtype"],
        "reference_source": meta["source"],
        "n_prompts": len(samples),
        "n_answer_positions": int(kl.numel()),
        "top_k": meta["top_k"],
        "max_abs_logit_diff": max(diffs) if diffs else 0.0,
        "mean_kl": kl.mean().item() if kl.numel() else 0.0,
        "max_kl": kl.max().item() if kl.numel() else 0.0,
        "top1_agreement": torch.cat(top1).mean().item() if top1 else 1.0,
        "generations_equal": len(samples) - len(mismatches),
        "generations_total": len(samples),
        "generation_mismatches": mismatches[:8],
        "stop_token_ids_expected": stops,
        "generation_config_eos_token_id": eos,
        "stop_tokens_missing": [t for t in stops if t not in eos],
    }


def judge(check: dict, numeric: bool = True) -> list[str]:
    """What is beyond tolerance, one line each (empty: the export reproduces the trained model). `numeric=False`
    checks the stop tokens only: for an export that is not meant to reproduce the trained model exactly (a QLoRA
    adapter merged into the original 16-bit base), whose numbers are reported, not judged."""
    tol = tolerance(check["dtype"], check["reference_dtype"])
    problems = []
    if check["stop_tokens_missing"]:
        problems.append(
            f"generation_config.json stops at {check['generation_config_eos_token_id']} but training taught answers "
            f"to end with {check['stop_tokens_missing']} (not listed): generation would run past the end of turn"
        )
    if not numeric:
        return problems
    if check["max_abs_logit_diff"] > tol["max_abs_logit_diff"]:
        problems.append(f"max |Δlogit| {check['max_abs_logit_diff']:.3g} > {tol['max_abs_logit_diff']:g}")
    if check["mean_kl"] > tol["mean_kl"]:
        problems.append(f"mean KL {check['mean_kl']:.3g} > {tol['mean_kl']:g}")
    n_bad = check["generations_total"] - check["generations_equal"]
    if n_bad > tol["generation_mismatch_fraction"] * check["generations_total"]:
        problems.append(
            f"{n_bad} of {check['generations_total']} greedy generations differ "
            f"(allowed in {check['dtype']}: {tol['generation_mismatch_fraction']:.0%})"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_stable.export.verify", description=__doc__.split("\n")[0])
    parser.add_argument("merged_dir")
    parser.add_argument("--reference", required=True)
    parser.add_argument("--json", required=True, help="where to write the numbers")
    parser.add_argument(
        "--structure-only", action="store_true", help="report the numbers, judge only stop tokens and the config"
    )
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.merged_dir, dtype="auto", device_map=device).eval()
    check = compare(model, args.reference)
    check["config_has_quantization_config"] = getattr(model.config, "quantization_config", None) is not None
    check["peft_imported"] = "peft" in sys.modules
    check["numbers_judged"] = not args.structure_only
    check["problems"] = judge(check, numeric=not args.structure_only)
    if check["config_has_quantization_config"]:
        check["problems"].append("config.json still carries a quantization_config")
    check["passed"] = not check["problems"]
    check["tolerances"] = tolerance(check["dtype"], check["reference_dtype"])
    Path(args.json).write_text(json.dumps(check, indent=2), encoding="utf-8")
    return 0 if check["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
