"""Data pipeline: JSONL → cleaned, tokenized, labelled samples → padded or packed batches, plus the audit."""

from hf_stable.data.audit import audit_dataset, audit_markdown
from hf_stable.data.bundle import AUDIT_FILE, DataBundle, build_data
from hf_stable.data.cleaning import clean_text
from hf_stable.data.collators import PackingCollator, PaddingCollator
from hf_stable.data.prompts import (
    Rendering,
    encode_prompt,
    prompt_text,
    reference_answer,
    render,
    resolve_template,
    stop_token_ids,
)
from hf_stable.data.records import read_records
from hf_stable.data.samples import IGNORE_INDEX, build_sample, encode_records

__all__ = [
    "AUDIT_FILE",
    "IGNORE_INDEX",
    "DataBundle",
    "PackingCollator",
    "PaddingCollator",
    "Rendering",
    "audit_dataset",
    "audit_markdown",
    "build_data",
    "build_sample",
    "clean_text",
    "encode_prompt",
    "encode_records",
    "prompt_text",
    "read_records",
    "reference_answer",
    "render",
    "resolve_template",
    "stop_token_ids",
]
