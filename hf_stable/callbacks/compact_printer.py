"""`CompactPrinter`: one short console line per log step instead of the Trainer's full metrics dict.

Every hf_stable metric still goes to the Trainer's logs (TensorBoard, W&B, trainer_state.json); the console
shows the headline numbers and leaves per-group detail to the report. Main process only.
"""

from __future__ import annotations

from transformers import TrainerCallback

from hf_stable.logging import print_main

# (log key, label, format) shown when present, in this order
HEADLINE = (
    ("loss", "loss", "{:.4f}"),
    ("grad/norm_global", "grad", "{:.3g}"),
    ("grad_norm", "grad", "{:.3g}"),
    ("learning_rate", "lr", "{:.2e}"),
    ("lr/factor", "lr factor", "{:.3g}"),
    ("attn/max_logit/max", "max logit", "{:.3g}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    ("mem/peak_gib", "peak GiB", "{:.2f}"),
    ("mem/rss_gib", "rss GiB", "{:.2f}"),
)


class CompactPrinter(TrainerCallback):
    """Print `step N/M | loss … | grad … | lr …`; non-namespaced keys (eval metrics, train summary) in full."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        parts = [f"step {state.global_step}/{state.max_steps}" if state.max_steps else "before training"]
        seen_labels = set()
        for key, label, fmt in HEADLINE:
            value = logs.get(key)
            if key == "lr/factor" and value == 1.0:
                continue  # only worth a column when a guard changed the LR
            if isinstance(value, (int, float)) and label not in seen_labels:
                parts.append(f"{label} {fmt.format(value)}")
                seen_labels.add(label)
        shown = {k for k, _, _ in HEADLINE}
        extra = {k: v for k, v in logs.items() if "/" not in k and k not in shown and k != "epoch"}
        if extra:
            parts.append(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items()))
        print_main(" | ".join(parts))
