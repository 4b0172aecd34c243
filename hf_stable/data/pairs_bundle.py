"""`build_pairs`: preference-pair files to the tokenized datasets TRL's ``DPOTrainer`` trains on, plus their audit.

Each pair is tokenized by hf_stable under the SFT rules (``pairs.py`` → ``samples.py``): the prompt exactly as the
SFT run was given it, each answer through its end-of-turn token, cut to ``data.max_length`` keeping the end token.
The datasets hold TRL's tokenized columns (``prompt_ids``, ``chosen_ids``, ``rejected_ids``), so TRL does not
tokenize the text again its own way (it would tokenize prompt + answer as one string, add the tokenizer's BOS to a
chat prompt that already has it, and append an EOS after the end-of-turn token).

``data.eval_file: auto`` resolves as for SFT: ``embedded:pairs_eval`` for ``embedded:pairs_train``, a seeded
held-out split of the user's own pair file otherwise (``holdout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_stable.data.holdout import AUTO, holdout_size, split_holdout
from hf_stable.data.pairs import encode_pairs, read_pairs
from hf_stable.data.prompts import resolve_template
from hf_stable.data.samples import IGNORE_INDEX
from hf_stable.errors import DataError
from hf_stable.logging import get_logger
from hf_stable.resources import embedded_dataset_name

logger = get_logger(__name__)

EMBEDDED_PAIRS_EVAL = "embedded:pairs_eval"


@dataclass
class PairsBundle:
    """Tokenized preference datasets of one run.

    Attributes:
        train_dataset / eval_dataset: ``datasets.Dataset`` with ``prompt_ids``, ``chosen_ids``, ``rejected_ids``
            (eval: None without an eval file).
        eval_source: what the eval pairs are (a file, or ``"N pairs held out of FILE (seed S)"``).
        stats: per split: pairs read / kept / dropped by reason.
        template: the prompt template in use.
        train_where: ``file:line`` of each `train_dataset` row (`hf_stable.stabilize(trainer, records=...)` names a
            skipped DPO step's pairs by them).
    """

    train_dataset: Any
    eval_dataset: Any
    eval_source: str | None = None
    stats: dict = field(default_factory=dict)
    template: str = "alpaca"
    train_where: list = field(default_factory=list)


def resolve_pairs_eval(train_file: str, eval_file: str | None) -> str | None:
    """``auto`` → ``embedded:pairs_eval`` for an embedded pair set, a held-out split (``auto``) otherwise."""
    if eval_file != AUTO:
        return eval_file
    return EMBEDDED_PAIRS_EVAL if embedded_dataset_name(train_file) is not None else AUTO


def _rows(read, tokenizer, cfg, template: str, vocab_size, config_field: str) -> tuple[dict, dict, list]:
    kept, encoded, dropped = encode_pairs(
        tokenizer, read.records, max_length=cfg.max_length, template=template, vocab_size=vocab_size
    )
    if not kept:
        first = next((w[0] for w in dropped.values() if w), "?")
        raise DataError(
            f"{config_field}: no preference pair left in {read.records[0].path if read.records else '?'} "
            f"({ {k: len(v) for k, v in dropped.items()} }); first: {first} (raise data.max_length)"
        )
    chosen = {s["record_id"]: s for s in encoded["chosen"][0]}
    rejected = {s["record_id"]: s for s in encoded["rejected"][0]}
    columns: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for i in kept:
        c, r = chosen[i], rejected[i]
        n = next(k for k, x in enumerate(c["labels"]) if x != IGNORE_INDEX)
        n_r = next(k for k, x in enumerate(r["labels"]) if x != IGNORE_INDEX)
        if c["input_ids"][:n] != r["input_ids"][:n_r]:
            raise DataError(
                f"{read.records[i].where}: 'chosen' and 'rejected' do not answer the same conversation (their prompts "
                "render differently); put the shared turns in 'prompt' and only the answer in each"
            )
        columns["prompt_ids"].append(c["input_ids"][:n])
        columns["chosen_ids"].append(c["input_ids"][n:])
        columns["rejected_ids"].append(r["input_ids"][n:])
    skipped = dict(read.skipped)
    for reason, wheres in dropped.items():
        skipped[reason] = skipped.get(reason, 0) + len(wheres)
    stats = {"read": read.n_lines, "kept": len(kept), "dropped": sum(skipped.values()), "dropped_reasons": skipped}
    return columns, stats, [read.records[i].where for i in kept]


def build_pairs(cfg, tokenizer, *, seed: int = 42, vocab_size: int | None = None) -> PairsBundle:
    """Read, check, clean and tokenize `cfg.train_file` / `cfg.eval_file` (a `DataConfig`) as preference pairs.

    Raises:
        DataError: a bad line (file:line) unless ``on_bad_record: skip``; no pair left to train on.

    Example:
        >>> pairs = build_pairs(cfg.data, tokenizer, seed=42)
        >>> DPOTrainer(model, args=args, train_dataset=pairs.train_dataset, eval_dataset=pairs.eval_dataset, ...)
    """
    from datasets import Dataset

    template = resolve_template(tokenizer, cfg.template)

    def read(path: str, config_field: str):
        return read_pairs(path, config_field=config_field, on_bad_record=cfg.on_bad_record, clean=cfg.clean)

    eval_file = resolve_pairs_eval(cfg.train_file, cfg.eval_file)
    train_read = read(cfg.train_file, "data.train_file")
    eval_read, eval_source = None, eval_file
    if eval_file == AUTO:
        fraction, most = getattr(cfg, "eval_fraction", 0.1), getattr(cfg, "eval_max_records", 200)
        if holdout_size(len(train_read.records), fraction, most):
            train_read, eval_read = split_holdout(train_read, fraction=fraction, max_records=most, seed=seed)
            eval_source = f"{len(eval_read.records)} pairs held out of {cfg.train_file} (seed {seed})"
            logger.info("data: evaluating on %s; they are not trained on", eval_source)
        else:
            eval_source = None
    elif eval_file:
        eval_read = read(eval_file, "data.eval_file")
    train_cols, train_stats, train_where = _rows(train_read, tokenizer, cfg, template, vocab_size, "data.train_file")
    stats = {"train": train_stats, "eval": None}
    eval_ds = None
    if eval_read is not None:
        eval_cols, stats["eval"], _ = _rows(eval_read, tokenizer, cfg, template, vocab_size, "data.eval_file")
        eval_ds = Dataset.from_dict(eval_cols)
    for split, s in stats.items():
        if s and s["dropped"]:
            logger.warning(
                "data (%s pairs): %d of %d dropped: %s", split, s["dropped"], s["read"], s["dropped_reasons"]
            )
    return PairsBundle(Dataset.from_dict(train_cols), eval_ds, eval_source, stats, template, train_where)
