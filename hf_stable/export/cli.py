"""`hf-stable export RUN_DIR [--out DIR] [--dtype float32|bfloat16|float16]`: merged, verified checkpoint."""

from __future__ import annotations

import argparse

from hf_stable.export.merge import DTYPES


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-stable export",
        description="Merge a run's LoRA adapter into its base, save a standalone checkpoint and verify it against "
        "the logits and generations recorded at the end of training.",
    )
    parser.add_argument("run_dir", help="the run's training.output_dir")
    parser.add_argument("--out", default=None, help="where to write the checkpoint (default: RUN_DIR/merged)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default=None, help="default: the run's export.dtype")
    parser.add_argument(
        "--qlora-base",
        choices=("dequantized", "original"),
        default=None,
        help="QLoRA runs: merge into the dequantized 4-bit weights (default) or the original 16-bit base",
    )
    args = parser.parse_args(argv)
    from hf_stable.export.exporter import export_run

    result = export_run(args.run_dir, out=args.out, dtype=args.dtype, qlora_base=args.qlora_base)
    c = result["check"]
    print(
        f"exported {result['dir']} ({result['dtype']}): max |Δlogit| {c['max_abs_logit_diff']:.3g}, mean KL "
        f"{c['mean_kl']:.3g}, greedy generations equal {c['generations_equal']}/{c['generations_total']}"
        + (
            f", QLoRA dequantized vs original base: mean |Δlogit| {c['qlora']['mean_abs_logit_diff']:.3g}"
            if c.get("qlora")
            else ""
        )
    )
    return 0
