"""Config section for training data: files, format, cleaning, labels, batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_stable.resources import data_file, embedded_data_paths, embedded_dataset_name


@dataclass
class DataConfig:
    """Where the data is and how it becomes batches."""

    train_file: str = field(
        default="embedded:train",
        metadata={"help": "Training JSONL (alpaca or chat/messages); embedded:train is the packaged dataset."},
    )
    eval_file: str | None = field(
        default="auto",
        metadata={
            "help": "Held-out JSONL for eval loss and exact match; embedded:eval is the packaged one; auto = "
            "embedded:eval for the embedded train set, else a seeded held-out split of train_file "
            "(eval_fraction, eval_max_records); null = no evaluation."
        },
    )
    eval_fraction: float = field(
        default=0.1,
        metadata={
            "help": "eval_file: auto on your own train file: the fraction of its records held out (at least 1)."
        },
    )
    eval_max_records: int = field(
        default=200, metadata={"help": "eval_file: auto on your own train file: at most this many held out."}
    )
    format: Literal["auto", "alpaca", "chat"] = field(
        default="auto", metadata={"help": "Record format; auto looks at the first record's keys."}
    )
    max_length: int = field(default=256, metadata={"help": "Max tokens per sample (prompt + response + EOS)."})
    packing: bool = field(default=True, metadata={"help": "Padding-free packing with per-sample position_ids."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad padded batches to a multiple."})
    shape_buckets: int | None = field(
        default=None,
        metadata={
            "help": "Compile-friendly shapes: every batch's length (a packed batch's row width) is padded up to a "
            "multiple of this, so torch.compile sees at most max_length / shape_buckets lengths instead of a new one "
            "almost every step. Pad positions are labelled -100 (the loss is unchanged) and cost compute. null = 32 "
            "when training.torch_compile is true, else off; 0 = off."
        },
    )
    packing_row_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Packed rows hold at most this many tokens (balanced rows); null = max_length; 0 = the whole "
            "batch in one row (best with flash-attn varlen; with sdpa/eager attention cost grows with row length²)."
        },
    )
    clean: bool = field(default=True, metadata={"help": "Remove zero-width/control characters and NFC-normalise."})
    on_bad_record: Literal["error", "skip"] = field(
        default="error", metadata={"help": "Malformed record: stop with file:line, or skip and count it."}
    )
    template: Literal["auto", "chat_template", "alpaca"] = field(
        default="auto", metadata={"help": "Prompt format: the tokenizer's chat template when it has one, or alpaca."}
    )
    exclude_file: str | None = field(
        default=None,
        metadata={
            "help": "Leave out the records this file names: a quarantine.jsonl of an earlier run, or one "
            "file:line / content hash a line (counted as 'excluded' in the audit)."
        },
    )
    quarantine: Literal["auto", "report", "off"] = field(
        default="off",
        metadata={
            "help": "Records named as the culprits of a bad step: auto = write quarantine.jsonl and never "
            "train on them again (kept in checkpoints); report = write the file only; off = no forensics."
        },
    )
    screen: bool = field(
        default=False,
        metadata={
            "help": "Screen every step's per-sample losses for robust outliers (on device, decisions batched), "
            "re-run suspects with and without their prompt (prompt_mismatch), quarantine degenerate answers before "
            "the first step, and keep every record's loss trajectory across epochs (named at an epoch's end when it stands "
            "out: mislabeled answers), all through the same quarantine. For a base that follows prompts."
        },
    )
    audit: bool = field(default=True, metadata={"help": "Run the data audit before training (saved in output)."})
    padding_alert: float = field(
        default=0.75, metadata={"help": "Audit alert when padding tokens exceed this fraction of batch tokens."}
    )
    near_duplicate_threshold: float = field(
        default=0.8, metadata={"help": "Audit: records with estimated Jaccard similarity >= this are near-duplicates."}
    )

    def validate(self) -> list[str]:
        problems = []
        if self.max_length < 8:
            problems.append(f"max_length: got {self.max_length}, must be >= 8")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of <= 0:
            problems.append(f"pad_to_multiple_of: got {self.pad_to_multiple_of}, must be > 0 or null")
        if self.shape_buckets is not None and self.shape_buckets < 0:
            problems.append(f"shape_buckets: got {self.shape_buckets}, must be >= 0 or null")
        if self.packing_row_tokens is not None and self.packing_row_tokens < 0:
            problems.append(f"packing_row_tokens: got {self.packing_row_tokens}, must be >= 0 or null")
        if not 0.0 < self.padding_alert <= 1.0:
            problems.append(f"padding_alert: got {self.padding_alert}, must be in (0, 1]")
        if not 0.0 < self.near_duplicate_threshold <= 1.0:
            problems.append(f"near_duplicate_threshold: got {self.near_duplicate_threshold}, must be in (0, 1]")
        if not 0.0 < self.eval_fraction < 1.0:
            problems.append(f"eval_fraction: got {self.eval_fraction}, must be in (0, 1)")
        if self.eval_max_records < 1:
            problems.append(f"eval_max_records: got {self.eval_max_records}, must be >= 1")
        if not self.train_file:
            problems.append("train_file: empty, name a JSONL file")
        evals = () if self.eval_file == "auto" else (("eval_file", self.eval_file),)
        for name, path in (("train_file", self.train_file), *evals):
            if embedded_dataset_name(path) is not None and data_file(path) is None:
                problems.append(f"{name}: got {path!r}, the packaged datasets are: {', '.join(embedded_data_paths())}")
        return problems
