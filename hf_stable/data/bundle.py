"""`build_data`: from a `DataConfig` and a tokenizer to everything the Trainer needs.

The recipe calls this once; it reads and checks the JSONL files (``records.py``), cleans them
(``cleaning.py``), builds prompts and labels (``prompts.py``, ``samples.py``), wraps the samples in
``datasets.Dataset`` objects, picks the collators (``collators.py``) and audits the result
(``audit.py``), writing ``data_audit.json`` into the output dir when one is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_stable.data.audit import packing_row_tokens, summarize
from hf_stable.data.collators import PackingCollator, PaddingCollator, shape_multiple
from hf_stable.data.holdout import AUTO, resolve_eval_file, split_holdout
from hf_stable.data.identity import RecordTable, exclude_records, read_exclusions
from hf_stable.data.prompts import encode_prompts, eos_id, resolve_template, stop_token_ids
from hf_stable.data.records import read_records
from hf_stable.data.samples import IGNORE_INDEX, encode_records
from hf_stable.errors import DataError
from hf_stable.logging import get_logger, is_main_process

logger = get_logger(__name__)

AUDIT_FILE = "data_audit.json"


@dataclass
class DataBundle:
    """Datasets, collators and reports of one run.

    Attributes:
        train_dataset: ``datasets.Dataset`` with ``input_ids`` and ``labels`` (use ``remove_unused_columns=False``).
        eval_dataset: the same for ``data.eval_file``, or None.
        collator: packing collator when ``data.packing`` else padding collator (the Trainer's ``data_collator``).
        eval_collator: right-padding collator (evaluation batches).
        eval_records: cleaned eval records (extra keys kept) for exact-match generation with
            `encode_prompt` / `reference_answer`.
        eval_source: what the eval set is, for the console and the model card: the eval file, or
            ``"N records held out of FILE (seed S)"`` (``data.eval_file: auto`` on the user's own train file).
        eval_answer_tokens: supervised tokens (answer + end token) of each eval record, in `eval_records` order:
            whether exact match can compare the answers (`hf_stable.evaluation.exact_match_skip_reason`).
        audit: ``{"train": audit dict, "eval": audit dict or None}`` (empty when ``data.audit`` is off).
        stats: ``{"train": {...}, "eval": {...}}`` counts read / cleaned / kept / dropped by reason.
        template: the prompt template in use (``"chat_template"`` or ``"alpaca"``).
        stop_token_ids: what generation stops at: the end tokens of the training samples' supervised spans (the
            template's end of turn), then the tokenizer's EOS; exact match stops there and the saved
            ``generation_config.json`` lists them (`hf_stable.reporting.save_generation_config`).
        format: the record format of the train file (``"alpaca"`` or ``"chat"``).
        records: the train file's `RecordTable` (``record_id`` -> file:line, hash, preview); the train dataset
            carries a ``record_id`` column, and `StableTrainer` turns on the collator's ``return_record_ids`` (a
            stock Trainer would pass them to the model's forward).
    """

    train_dataset: Any
    eval_dataset: Any
    collator: Any
    eval_collator: Any
    eval_records: list[dict] = field(default_factory=list)
    eval_source: str | None = None
    eval_answer_tokens: list[int] = field(default_factory=list)
    audit: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    template: str = "alpaca"
    stop_token_ids: list[int] = field(default_factory=list)
    format: str = "alpaca"
    records: RecordTable = field(default_factory=RecordTable)


def _stats(read, enc) -> dict:
    dropped = dict(read.skipped)
    for reason, n in enc.dropped.items():
        dropped[reason] = dropped.get(reason, 0) + n
    return {
        "read": read.n_lines,
        "good": len(read.records),
        "cleaned": read.cleaning.records_changed,
        "chars_removed": read.cleaning.chars_removed,
        "kept": enc.n_kept,
        "truncated": enc.n_truncated,
        "dropped": sum(dropped.values()),
        "dropped_reasons": dropped,
    }


def _say_holdout(train_file: str, train, held, seed: int) -> str | None:
    """One console line saying what the run evaluates on when ``data.eval_file`` is ``auto`` on the user's file."""
    n_all = len(train.records) + len(held.records)
    if not held.records:
        logger.warning(
            "data.eval_file auto: %s has %d good record(s), too few to hold any out: no evaluation "
            "(set data.eval_file to an eval JSONL)",
            train_file,
            n_all,
        )
        return None
    source = f"{len(held.records)} records held out of {train_file} (seed {seed})"
    logger.info(
        "data: evaluating on %d of %d records held out of %s (data.eval_file: auto, seed %d); "
        "they are not trained on. Set data.eval_file to use your own eval file",
        len(held.records),
        n_all,
        train_file,
        seed,
    )
    return source


NAMED_DROPS = 3  # dropped records named on the console; the rest are in data_audit.json


def _say_dropped(config_field: str, read, enc, audit_file: Path | None) -> None:
    """Name the first dropped records (``file:line: reason``) on the console, then how many more and where they
    are listed: a count by reason alone leaves the user searching the file. Records left out on purpose by
    ``data.exclude_file`` are not drops."""
    examples = read.skipped_examples + enc.dropped_examples
    n = sum(v for k, v in read.skipped.items() if k != "excluded") + sum(enc.dropped.values())
    if not n:
        return
    lines = examples[:NAMED_DROPS]
    if n > len(lines):
        where = f"see {audit_file}" if audit_file is not None else "`hf-stable audit FILE --skip-bad` lists them"
        lines.append(f"+{n - len(lines)} more, {where}")
    logger.warning("%s: %d record(s) dropped:\n  %s", config_field, n, "\n  ".join(lines))


def _answer_tokens(dataset) -> list[int]:
    return [sum(1 for x in labels if x != IGNORE_INDEX) for labels in dataset["labels"]]


def build_data(
    cfg,
    tokenizer,
    *,
    seed: int = 0,
    output_dir: str | None = None,
    batch_size: int = 8,
    vocab_size: int | None = None,
    torch_compile: bool = False,
) -> DataBundle:
    """Read, clean, tokenize and audit ``cfg.train_file`` / ``cfg.eval_file``.

    Args:
        cfg: the run's `DataConfig`.
        tokenizer: a fast tokenizer with an EOS token (and ideally a chat template).
        seed: seeds the audit's batching simulation and MinHash.
        output_dir: when given and ``cfg.audit``, the audit is written to ``output_dir/data_audit.json``.
        batch_size: per-device train batch size, used for the audit's padding ratio.
        vocab_size: token ids must be below this (pass the model's embedding rows); default ``len(tokenizer)``.
        torch_compile: training is compiled (``training.torch_compile``): ``data.shape_buckets: null`` then pads
            batch lengths to multiples of 32 (`collators.shape_multiple`).

    Raises:
        DataError: missing/empty file, a bad line (unless ``on_bad_record: skip``), a token id outside the
            vocabulary, or no sample left — each naming the file, line or config field.

    Example:
        >>> data = build_data(cfg.data, tokenizer, seed=cfg.training.get("seed", 42), output_dir=out)
        >>> trainer = Trainer(model, args, train_dataset=data.train_dataset, data_collator=data.collator, ...)
    """
    from datasets import Dataset

    template = resolve_template(tokenizer, cfg.template)
    eos = eos_id(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos  # masked by position

    exclusions = read_exclusions(getattr(cfg, "exclude_file", None))

    def read(path: str, config_field: str):
        return read_records(
            path, config_field=config_field, format=cfg.format, on_bad_record=cfg.on_bad_record, clean=cfg.clean
        )

    def load(read, path: str, config_field: str, train: bool = False):
        if train:
            n_excluded = exclude_records(read, exclusions)
            if n_excluded:
                logger.info("data.exclude_file: %d records of %s left out", n_excluded, path)
            if not read.records:
                raise DataError(f"data.exclude_file excludes every record of {path}; nothing left to train on")
        samples, enc = encode_records(
            tokenizer, read.records, max_length=cfg.max_length, template=template, vocab_size=vocab_size
        )
        if not samples:
            raise DataError(
                f"{config_field}: no sample left in {path}: {_stats(read, enc)['dropped_reasons']}; "
                f"first: {(enc.dropped_examples or ['?'])[0]} (raise data.max_length)"
            )
        audit = None
        if cfg.audit:
            audit = summarize(
                read,
                samples,
                enc,
                cfg,
                tokenizer=tokenizer,
                batch_size=batch_size,
                seed=seed,
                template=template,
                path=str(path),
            )
        drops.append((config_field, read, enc))
        columns = {"input_ids": [s["input_ids"] for s in samples], "labels": [s["labels"] for s in samples]}
        if train:
            columns["record_id"] = [s["record_id"] for s in samples]
        return read, enc, Dataset.from_dict(columns), audit

    drops: list = []  # (config field, ReadResult, EncodeStats) per file, for the dropped records named below
    eval_file = resolve_eval_file(cfg.train_file, cfg.eval_file)
    train_read = read(cfg.train_file, "data.train_file")
    held = None
    if eval_file == AUTO:
        train_read, held = split_holdout(
            train_read,
            fraction=getattr(cfg, "eval_fraction", 0.1),
            max_records=getattr(cfg, "eval_max_records", 200),
            seed=seed,
        )
        eval_source = _say_holdout(cfg.train_file, train_read, held, seed)
    else:
        eval_source = eval_file
    train_read, train_enc, train_ds, train_audit = load(train_read, cfg.train_file, "data.train_file", train=True)
    stats = {"train": _stats(train_read, train_enc), "eval": None}
    audit: dict = {"train": train_audit, "eval": None} if cfg.audit else {}
    eval_ds, eval_records, eval_answer_tokens = None, [], []
    if eval_file and (held is None or held.records):
        eval_read = held if held is not None else read(eval_file, "data.eval_file")
        eval_path = f"{cfg.train_file} (held out)" if held is not None else eval_file
        eval_read, eval_enc, eval_ds, eval_audit = load(eval_read, eval_path, "data.eval_file")
        eval_records = [r.data for r in eval_read.records]
        eval_answer_tokens = _answer_tokens(eval_ds)
        stats["eval"] = _stats(eval_read, eval_enc)
        if cfg.audit:
            audit["eval"] = eval_audit

    for name, a in audit.items():
        for alert in (a or {}).get("alerts", []):
            logger.warning("data audit (%s): %s", name, alert)
    written = bool(output_dir and cfg.audit)
    if written and is_main_process():  # every rank computes the same audit; one writes it
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / AUDIT_FILE).write_text(json.dumps(audit, indent=2, ensure_ascii=False), encoding="utf-8")
    for config_field, read_result, enc in drops:
        _say_dropped(config_field, read_result, enc, Path(output_dir) / AUDIT_FILE if written else None)

    multiple = shape_multiple(cfg.pad_to_multiple_of, getattr(cfg, "shape_buckets", None), torch_compile)
    if cfg.packing:
        collator = PackingCollator(pad, multiple, max_row_tokens=packing_row_tokens(cfg))
    else:
        collator = PaddingCollator(pad, multiple)
    return DataBundle(
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        collator=collator,
        eval_collator=PaddingCollator(pad, multiple),
        eval_records=eval_records,
        eval_source=eval_source,
        eval_answer_tokens=eval_answer_tokens,
        audit=audit,
        stats=stats,
        template=template,
        stop_token_ids=stop_token_ids(tokenizer, template, train_enc.end_tokens),
        format=train_read.format,
        records=RecordTable.from_records(
            train_read.records, encode_prompts(tokenizer, [{"instruction": "", "input": ""}], template)[0]
        ),
    )
