"""Config section for training data: files, format, cleaning, labels, batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DataConfig:
    """Where the data is and how it becomes batches."""

    train_file: str = field(
        default="data/embedded/train.jsonl", metadata={"help": "Training JSONL (alpaca or chat/messages)."}
    )
    eval_file: str | None = field(
        default="data/embedded/eval.jsonl", metadata={"help": "Held-out JSONL for eval loss and exact match."}
    )
    format: Literal["auto", "alpaca", "chat"] = field(
        default="auto", metadata={"help": "Record format; auto looks at the first record's keys."}
    )
    max_length: int = field(default=256, metadata={"help": "Max tokens per sample (prompt + response + EOS)."})
    packing: bool = field(default=True, metadata={"help": "Padding-free packing with per-sample position_ids."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad padded batches to a multiple."})
    clean: bool = field(default=True, metadata={"help": "Remove zero-width/control characters and NFC-normalise."})
    on_bad_record: Literal["error", "skip"] = field(
        default="error", metadata={"help": "Malformed record: stop with file:line, or skip and count it."}
    )
    template: Literal["auto", "chat_template", "alpaca"] = field(
        default="auto", metadata={"help": "Prompt format: the tokenizer's chat template when it has one, or alpaca."}
    )
    audit: bool = field(default=True, metadata={"help": "Run the data audit before training (saved in output)."})

    def validate(self) -> list[str]:
        problems = []
        if self.max_length < 8:
            problems.append(f"max_length: got {self.max_length}, must be >= 8")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of <= 0:
            problems.append(f"pad_to_multiple_of: got {self.pad_to_multiple_of}, must be > 0 or null")
        if not self.train_file:
            problems.append("train_file: empty, name a JSONL file")
        return problems
