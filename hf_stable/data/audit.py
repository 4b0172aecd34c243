"""Data audit: what the pipeline read, cleaned, dropped and will batch — before any GPU time is spent.

Run on the command line (``hf-stable audit DATA.jsonl --tokenizer DIR [--json]``) or automatically by
`build_data` at the start of a run (saved as ``data_audit.json`` in the output dir and summarised in
the model card with `audit_markdown`). Every number is measured on the samples the trainer will see,
built by the same code (``records.py`` → ``samples.py``), not re-derived.

Keys of the audit dict (JSON-safe): ``n_records`` (non-blank lines read), ``n_kept``, ``n_dropped`` and
``dropped_reasons`` (bad lines skipped + samples without a supervised token), ``n_cleaned`` /
``n_chars_removed`` / ``cleaning``, ``eos_coverage`` (kept samples whose last supervised label is a stop token:
the template's end of turn, or EOS without a template), ``chat_rendering`` (how records became prompt + supervised
span, see ``prompts.py``), ``thinking`` (records of a thinking template rendered with thinking off / on),
``n_aligned`` / ``n_reasoning_dropped`` (renderings aligned; reasoning blocks the template leaves out),
``end_tokens`` (kept samples by the token ending their span), ``stop_tokens`` (what generation stops at: the
saved ``generation_config.json`` lists them), ``sample`` (the first kept sample decoded, supervised span marked),
``label_coverage`` (supervised tokens / tokens), ``padding_ratio`` (padding tokens / batch tokens of the
configured batching; ``padding_ratio_padded`` for plain padding), ``duplicate_rate`` (exact + near),
``length_histogram``, ``n_truncated`` and ``alerts``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from hf_stable.data.collators import pack_rows
from hf_stable.data.duplicates import duplicate_stats
from hf_stable.data.identity import exclude_records, read_exclusions
from hf_stable.data.prompts import answer_text, describe_rendering, prompt_messages, resolve_template, stop_token_ids
from hf_stable.data.records import ReadResult, read_records
from hf_stable.data.sample_view import sample_markdown, sample_view
from hf_stable.data.samples import IGNORE_INDEX, EncodeStats, encode_records
from hf_stable.errors import ModelError


def padding_ratio(
    lengths: list[int], batch_size: int, *, packing: bool, pad_to_multiple_of=None, seed=0, row_tokens=None
) -> float:
    """Padding tokens / batch tokens for batches drawn in random order (as the Trainer's sampler does).

    Packed batches are laid out exactly as `PackingCollator` does (rows of at most `row_tokens`, or one row).
    """
    if not lengths:
        return 0.0
    order = list(lengths)
    random.Random(seed).shuffle(order)
    real = total = 0
    m = pad_to_multiple_of or 1
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        if packing:
            rows = pack_rows(chunk, row_tokens)
            width, n_rows = max(sum(chunk[i] for i in row) for row in rows), len(rows)
        else:
            width, n_rows = max(chunk), len(chunk)
        real += sum(chunk)
        total += -(-width // m) * m * n_rows
    return 1.0 - real / total


def length_histogram(lengths: list[int], max_length: int) -> dict:
    """Counts of sample lengths in power-of-two bins up to ``max_length``: bin i is (edges[i], edges[i+1]]."""
    edges = [0] + [2**k for k in range(3, 20) if 2**k < max_length] + [max_length]
    counts = [0] * (len(edges) - 1)
    for n in lengths:
        for i in range(len(counts)):
            if n <= edges[i + 1] or i == len(counts) - 1:
                counts[i] += 1
                break
    return {"edges": edges, "counts": counts}


def packing_row_tokens(cfg) -> int | None:
    """Tokens per packed row under `cfg` (``data.packing_row_tokens``; null → max_length; 0 → one row → None)."""
    n = getattr(cfg, "packing_row_tokens", None)
    return (cfg.max_length if n is None else n) or None


def _record_text(data: dict) -> str:
    return "\n".join(m["content"] for m in prompt_messages(data)) + "\n" + answer_text(data)


def summarize(
    read: ReadResult,
    samples: list[dict],
    enc: EncodeStats,
    cfg,
    *,
    tokenizer,
    batch_size: int = 8,
    seed: int = 0,
    template: str = "alpaca",
    path: str = "",
) -> dict:
    """The audit dict of one file from what `read_records` and `encode_records` produced under `cfg` (DataConfig)."""
    stops = stop_token_ids(tokenizer, template, enc.end_tokens)
    max_length, packing, multiple = cfg.max_length, cfg.packing, cfg.pad_to_multiple_of
    row_tokens = packing_row_tokens(cfg)
    lengths = [len(s["input_ids"]) for s in samples]
    n_tokens = sum(lengths)
    n_sup = sum(sum(1 for x in s["labels"] if x != IGNORE_INDEX) for s in samples)
    sup_lasts = [[x for x in s["labels"] if x != IGNORE_INDEX][-1:] for s in samples]
    n_eos = sum(1 for last in sup_lasts if last and last[0] in stops)
    dropped = dict(read.skipped)
    for reason, n in enc.dropped.items():
        dropped[reason] = dropped.get(reason, 0) + n
    n_dropped = sum(dropped.values())
    ratio = padding_ratio(
        lengths, batch_size, packing=packing, pad_to_multiple_of=multiple, seed=seed, row_tokens=row_tokens
    )
    ratio_padded = padding_ratio(lengths, batch_size, packing=False, pad_to_multiple_of=multiple, seed=seed)
    threshold = getattr(cfg, "near_duplicate_threshold", 0.8)
    dups = duplicate_stats([_record_text(r.data) for r in read.records], threshold=threshold, seed=seed)
    srt = sorted(lengths)
    cleaning = read.cleaning.to_dict()
    out = {
        "file": path,
        "format": read.format,
        "template": template,
        "chat_rendering": describe_rendering(tokenizer, template, dict(enc.thinking), enc.n_aligned),
        "thinking": dict(enc.thinking),
        "n_aligned": enc.n_aligned,
        "n_reasoning_dropped": enc.n_reasoning_dropped,
        "end_tokens": dict(enc.end_tokens),
        "stop_tokens": tokenizer.convert_ids_to_tokens(stops),
        "sample": sample_view(tokenizer, enc.first),
        "n_records": read.n_lines,
        "n_blank_lines": read.n_blank,
        "n_kept": len(samples),
        "n_dropped": n_dropped,
        "dropped_reasons": dropped,
        "dropped_examples": (read.skipped_examples + enc.dropped_examples)[:20],
        "n_cleaned": cleaning["records_changed"],
        "n_chars_removed": cleaning["chars_removed"],
        "cleaning": cleaning["per_field"],
        "eos_coverage": n_eos / len(samples) if samples else 0.0,
        "n_tokens": n_tokens,
        "n_supervised_tokens": n_sup,
        "label_coverage": n_sup / n_tokens if n_tokens else 0.0,
        "batch_size": batch_size,
        "packing": packing,
        "packing_row_tokens": row_tokens if packing else None,
        "pad_to_multiple_of": multiple,
        "padding_ratio": ratio,
        "padding_ratio_padded": ratio_padded,
        "padding_alert_threshold": getattr(cfg, "padding_alert", 0.75),
        **dups,
        "max_length": max_length,
        "length": {
            "min": srt[0] if srt else 0,
            "mean": n_tokens / len(srt) if srt else 0.0,
            "p50": srt[len(srt) // 2] if srt else 0,
            "p95": srt[min(len(srt) - 1, int(0.95 * len(srt)))] if srt else 0,
            "max": srt[-1] if srt else 0,
        },
        "length_histogram": length_histogram(lengths, max_length),
        "n_truncated": enc.n_truncated,
    }
    out["alerts"] = _alerts(out)
    return out


def _alerts(a: dict) -> list[str]:
    alerts = []
    if a["padding_ratio"] > a["padding_alert_threshold"]:
        alerts.append(
            f"padding ratio {a['padding_ratio']:.0%} > {a['padding_alert_threshold']:.0%}: most of every batch is "
            "padding; set data.packing: true or use a smaller batch"
        )
    if a["n_dropped"]:
        alerts.append(f"{a['n_dropped']} of {a['n_records']} records dropped: {a['dropped_reasons']}")
    if a["n_kept"] and a["eos_coverage"] < 1.0:
        alerts.append(f"only {a['eos_coverage']:.1%} of samples end with a supervised stop token")
    if a.get("n_reasoning_dropped"):
        alerts.append(
            f"{a['n_reasoning_dropped']} answers carry a reasoning block (<think>...</think>) that the chat template "
            "leaves out of the assistant turn: only the text after it is trained"
        )
    if a["n_truncated"]:
        n, limit = a["n_truncated"], a["max_length"]
        alerts.append(f"{n} answers truncated to fit max_length {limit}; raise data.max_length")
    if a["duplicate_rate"] > 0.1:
        alerts.append(f"{a['duplicate_rate']:.0%} of records are exact or near duplicates")
    return alerts


def audit_dataset(
    path: str,
    tokenizer,
    cfg=None,
    *,
    batch_size: int = 8,
    seed: int = 0,
    vocab_size: int | None = None,
    config_field: str = "data.train_file",
    exclude=None,
    skip_hint: str | None = None,
) -> dict:
    """Audit one JSONL file as the trainer would see it under `cfg` (a `DataConfig`; defaults if None), without the
    records `exclude` names (a quarantine file or a list of file:line / hashes, see `read_exclusions`).

    Raises:
        DataError: as `read_records` / `encode_records` (bad lines unless ``on_bad_record: skip``).

    Example:
        >>> audit_dataset("data/embedded/train.jsonl", tok)["eos_coverage"]
        1.0
    """
    from hf_stable.config.data import DataConfig

    cfg = cfg or DataConfig()
    template = resolve_template(tokenizer, cfg.template)
    read = read_records(
        path,
        config_field=config_field,
        format=cfg.format,
        on_bad_record=cfg.on_bad_record,
        clean=cfg.clean,
        **({"skip_hint": skip_hint} if skip_hint else {}),
    )
    exclude_records(read, read_exclusions(exclude))
    samples, enc = encode_records(
        tokenizer, read.records, max_length=cfg.max_length, template=template, vocab_size=vocab_size
    )
    return summarize(
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


def audit_markdown(audit: dict) -> str:
    """A short Markdown summary of one audit (or ``{"train": ..., "eval": ...}``) for the model card."""
    if "n_records" not in audit:
        return "\n\n".join(f"### Data audit: {name}\n\n{audit_markdown(a)}" for name, a in audit.items() if a)
    a = audit
    rows = [
        ("rendering", a.get("chat_rendering", a.get("template", ""))),
        ("stop tokens (generation_config.json)", ", ".join(f"`{t}`" for t in a.get("stop_tokens", [])) or "—"),
        ("records read / kept / dropped", f"{a['n_records']} / {a['n_kept']} / {a['n_dropped']}"),
        ("dropped by reason", ", ".join(f"{k}: {v}" for k, v in a["dropped_reasons"].items()) or "none"),
        ("records cleaned (chars removed)", f"{a['n_cleaned']} ({a['n_chars_removed']})"),
        ("stop-token coverage (EOS / end of turn)", f"{a['eos_coverage']:.1%}"),
        ("label coverage (supervised / tokens)", f"{a['label_coverage']:.1%}"),
        (
            f"padding ratio ({'packed' if a['packing'] else 'padded'}, batch {a['batch_size']})",
            f"{a['padding_ratio']:.1%} (padded batches: {a['padding_ratio_padded']:.1%})",
        ),
        (
            "duplicates (exact + near)",
            f"{a['duplicate_rate']:.1%} ({a['exact_duplicates']} + {a['near_duplicates']})",
        ),
        ("length min / p50 / p95 / max", "{min} / {p50} / {p95} / {max}".format(**a["length"])),
        ("truncated answers", str(a["n_truncated"])),
    ]
    hist = a["length_histogram"]
    bins = " · ".join(f"≤{hi}: {c}" for hi, c in zip(hist["edges"][1:], hist["counts"], strict=False) if c)
    # a pipe inside a cell (`<|eot_id|>`) would split it, code span or not: GitHub's tables want it escaped
    lines = ["| check | value |", "|---|---|"] + [f"| {k} | {v.replace('|', chr(92) + '|')} |" for k, v in rows]
    lines += ["", f"Length histogram (tokens): {bins or 'empty'}"]
    if a["alerts"]:
        lines += ["", "Alerts:"] + [f"- ⚠ {x}" for x in a["alerts"]]
    if a.get("sample"):
        lines += ["", sample_markdown(a["sample"])]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-stable audit", description="Audit a JSONL dataset before training.")
    p.add_argument("data", help="alpaca or chat JSONL file")
    p.add_argument(
        "--tokenizer",
        required=True,
        help="what model.tokenizer / model.name_or_path accept: a directory, a Hub id, or embedded:tiny-<arch>",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text summary")
    p.add_argument("--max-length", type=int, default=None, help="data.max_length (default from DataConfig)")
    p.add_argument("--batch-size", type=int, default=8, help="per-device batch size used for the padding ratio")
    p.add_argument("--no-packing", action="store_true", help="audit padded batches instead of packed ones")
    p.add_argument("--pad-to-multiple-of", type=int, default=None)
    p.add_argument("--template", choices=["auto", "chat_template", "alpaca"], default="auto")
    p.add_argument("--format", choices=["auto", "alpaca", "chat"], default="auto")
    p.add_argument("--skip-bad", action="store_true", help="skip and count bad lines (data.on_bad_record: skip)")
    p.add_argument("--exclude", default=None, help="a quarantine.jsonl (or a list of file:line / hashes) to leave out")
    return p


def main(argv: list[str] | None = None) -> int:
    """``hf-stable audit DATA.jsonl --tokenizer DIR|HUB_ID|embedded:tiny-<arch> [--json]``; returns the exit code."""
    from hf_stable.config.data import DataConfig

    args = _parser().parse_args(argv)
    tok = audit_tokenizer(args.tokenizer)
    cfg = DataConfig(
        train_file=args.data,
        eval_file=None,
        format=args.format,
        template=args.template,
        packing=not args.no_packing,
        pad_to_multiple_of=args.pad_to_multiple_of,
        on_bad_record="skip" if args.skip_bad else "error",
    )
    if args.max_length:
        cfg.max_length = args.max_length
    audit = audit_dataset(
        args.data,
        tok,
        cfg,
        batch_size=args.batch_size,
        config_field="DATA",
        exclude=args.exclude,
        skip_hint="pass --skip-bad to skip and count bad lines",
    )
    if args.json:
        print(json.dumps(audit, ensure_ascii=False))
    else:
        print(f"Data audit of {args.data}\n\n{audit_markdown(audit)}\n\n{records_text(audit)}")
    return 0


def records_text(audit: dict) -> str:
    """The per-record detail of the text form: every dropped record as ``file:line: reason`` (as many as the
    audit keeps), then how many more, and what the audit's flags change."""
    examples = audit.get("dropped_examples") or []
    n = audit["n_dropped"] - audit["dropped_reasons"].get("excluded", 0)
    if not n:
        return "Dropped records: none"
    lines = [f"Dropped records ({n}):"] + [f"  {e}" for e in examples]
    if n > len(examples):
        lines.append(f"  +{n - len(examples)} more (--json lists the same first {len(examples)})")
    if audit.get("n_truncated"):
        lines.append(f"{audit['n_truncated']} answers truncated to max_length {audit['max_length']} (--max-length N)")
    return "\n".join(lines)


def audit_tokenizer(value: str):
    """The tokenizer `--tokenizer` names, read as the recipe reads `model.tokenizer`: ``embedded:tiny-<arch>`` (the
    embedded base's tokenizer; the base itself is not built), a directory, or a Hub id.

    Raises:
        ModelError: naming ``--tokenizer``: an unknown embedded name, a missing directory, a tokenizer that will
            not load.
    """
    from pathlib import Path

    from hf_stable.config.model import EMBEDDED_PREFIX, ModelConfig

    if value.startswith(EMBEDDED_PREFIX):
        model = ModelConfig(name_or_path=value)
        problems = model.validate()
        if problems:
            raise ModelError(f"--tokenizer: {'; '.join(problems)}")
        from hf_stable.embedded.builder import embedded_tokenizer

        return embedded_tokenizer(model.embedded_arch, model.embedded)
    path = Path(value).expanduser()
    if value.startswith(("/", "./", "../", "~")) and not path.is_dir():
        raise ModelError(
            f"--tokenizer: {value} is not a directory; pass a saved tokenizer directory, a Hub id or "
            "embedded:tiny-llama"
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if (path / "tokenizer.json").is_file():  # a saved fast tokenizer, read as it was written
            return PreTrainedTokenizerFast.from_pretrained(path)
        return AutoTokenizer.from_pretrained(value)
    except (OSError, ValueError) as e:
        raise ModelError(f"--tokenizer: cannot load a tokenizer from {value!r}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
