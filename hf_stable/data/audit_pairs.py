"""Audit of a preference-pair file (DPO data), and the ``hf-stable audit`` command for either kind of file.

A pair file is audited as SFT data is (``audit.py``): the chosen side of every pair is the sample the audit
measures (cleaning, drops by reason with file:line, stop-token coverage, label coverage, padding, duplicates,
lengths, truncation), built by the same code the trainer uses. Added for pairs: ``kind: "pairs"``, ``n_pairs``,
the rejected side's own numbers (``rejected``: lengths, truncation, stop-token coverage) and drops only a pair can
have (``same_answers``, ``same_after_truncation``, see ``pairs.py``). ``hf-stable audit FILE`` tells the kinds apart
by the first record's fields (``chosen`` and ``rejected``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import replace

from hf_stable.data.audit import _parser, audit_markdown, audit_tokenizer, records_text, summarize
from hf_stable.data.audit import main as audit_sft_main
from hf_stable.data.pairs import encode_pairs, is_pairs_file, read_pairs, side_records
from hf_stable.data.prompts import resolve_template, stop_token_ids
from hf_stable.data.samples import IGNORE_INDEX


def _side_numbers(samples: list[dict], enc, stops: list[int]) -> dict:
    lengths = sorted(len(s["input_ids"]) for s in samples)
    lasts = [[x for x in s["labels"] if x != IGNORE_INDEX][-1:] for s in samples]
    n_stop = sum(1 for last in lasts if last and last[0] in stops)
    return {
        "n_truncated": enc.n_truncated,
        "eos_coverage": n_stop / len(samples) if samples else 0.0,
        "length": {
            "min": lengths[0] if lengths else 0,
            "p50": lengths[len(lengths) // 2] if lengths else 0,
            "max": lengths[-1] if lengths else 0,
        },
    }


def audit_pairs(
    path: str,
    tokenizer,
    cfg=None,
    *,
    batch_size: int = 8,
    seed: int = 0,
    vocab_size: int | None = None,
    config_field: str = "dpo.train_file",
    skip_hint: str | None = None,
) -> dict:
    """Audit one preference-pair JSONL file under `cfg` (a `DataConfig`: template, max_length, on_bad_record, clean).

    Raises:
        DataError: as `read_pairs` / `encode_records` (bad lines unless ``on_bad_record: skip``).

    Example:
        >>> a = audit_pairs("embedded:pairs_eval", tok)
        >>> a["kind"], a["n_pairs"], a["rejected"]["eos_coverage"]
        ('pairs', 200, 1.0)
    """
    from hf_stable.config.data import DataConfig

    cfg = cfg or DataConfig()
    template = resolve_template(tokenizer, cfg.template)
    fmt = cfg.format if cfg.format in ("text", "chat") else "auto"
    read = read_pairs(
        path,
        config_field=config_field,
        format=fmt,
        on_bad_record=cfg.on_bad_record,
        clean=cfg.clean,
        **({"skip_hint": skip_hint} if skip_hint else {}),
    )
    kept, encoded, dropped = encode_pairs(
        tokenizer, read.records, max_length=cfg.max_length, template=template, vocab_size=vocab_size
    )
    keep = set(kept)
    samples = {side: [s for s in encoded[side][0] if s["record_id"] in keep] for side in encoded}
    chosen_enc = encoded["chosen"][1]
    why = {
        "no_supervised_token": "the prompt leaves no room for one of the answers within max_length",
        "same_after_truncation": f"chosen and rejected are the same tokens once cut to max_length {cfg.max_length}",
    }
    enc = replace(
        chosen_enc,
        dropped=Counter({reason: len(wheres) for reason, wheres in dropped.items()}),
        dropped_examples=[f"{w}: {why[reason]}" for reason, wheres in dropped.items() for w in wheres][:20],
    )
    chosen_read = replace(read, records=side_records(read.records, "chosen"))
    out = summarize(
        chosen_read,
        samples["chosen"],
        enc,
        cfg,
        tokenizer=tokenizer,
        batch_size=batch_size,
        seed=seed,
        template=template,
        path=str(path),
    )
    stops = stop_token_ids(tokenizer, template, chosen_enc.end_tokens)
    rejected = _side_numbers(samples["rejected"], encoded["rejected"][1], stops)
    out.update(kind="pairs", n_pairs=len(kept), rejected=rejected)
    if rejected["n_truncated"]:
        out["alerts"].append(
            f"{rejected['n_truncated']} rejected answers truncated to fit max_length {cfg.max_length}: a cut "
            "answer is judged on its start only; raise data.max_length"
        )
    if samples["rejected"] and rejected["eos_coverage"] < 1.0:
        out["alerts"].append(f"only {rejected['eos_coverage']:.1%} of rejected answers end with a stop token")
    return out


def pairs_text(audit: dict) -> str:
    """The pair-only lines of the text form."""
    r = audit["rejected"]
    return (
        f"Preference pairs kept: {audit['n_pairs']} (the table above measures the chosen side)\n"
        f"Rejected side: length min / p50 / max {r['length']['min']} / {r['length']['p50']} / {r['length']['max']}, "
        f"truncated {r['n_truncated']}, stop-token coverage {r['eos_coverage']:.1%}"
    )


def main(argv: list[str] | None = None) -> int:
    """``hf-stable audit FILE --tokenizer ...``: SFT records, or preference pairs when the first record has
    ``chosen`` and ``rejected``; returns the exit code."""
    from hf_stable.config.data import DataConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if not is_pairs_file(args.data):
        return audit_sft_main(argv)
    cfg = DataConfig(
        train_file=args.data,
        eval_file=None,
        format="chat" if args.format == "chat" else "auto",
        template=args.template,
        packing=not args.no_packing,
        pad_to_multiple_of=args.pad_to_multiple_of,
        on_bad_record="skip" if args.skip_bad else "error",
    )
    if args.max_length:
        cfg.max_length = args.max_length
    audit = audit_pairs(
        args.data,
        audit_tokenizer(args.tokenizer),
        cfg,
        batch_size=args.batch_size,
        config_field="DATA",
        skip_hint="pass --skip-bad to skip and count bad lines",
    )
    if args.json:
        print(json.dumps(audit, ensure_ascii=False))
    else:
        print(f"Data audit of {args.data}\n\n{audit_markdown(audit)}\n\n{pairs_text(audit)}\n\n{records_text(audit)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
