"""Generate the embedded instruction dataset (alpaca JSONL) from the task templates.

    python scripts/make_dataset.py [--seed 0] [--out data/embedded]

Writes train.jsonl (~2k records, some deliberately dirty: zero-width and control characters, empty
`input`, outputs with and without a trailing newline) and eval.jsonl (~200 held-out prompts that never
appear in train), grpo.jsonl (600 clean prompts of the arithmetic, reversal and unit conversion families with
their `answer`, for the GRPO stage; none is an eval prompt) and the DPO preference pairs pairs_train.jsonl /
pairs_eval.jsonl (``hf_stable/embedded/pairs.py``: chosen = the computed answer, rejected = a plausible wrong one).
The files are committed as package data (`hf_stable/embedded/data`, which `data/embedded` links to; recipes name them
`embedded:train` / `embedded:eval` / `embedded:grpo` / `embedded:pairs_train` / `embedded:pairs_eval`); rerunning
with the same seed reproduces them byte for byte.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_stable.embedded.pairs import preference_pairs
from hf_stable.embedded.tasks import grpo_prompts, instruction_dataset

# Characters that some line readers treat as line breaks (str.splitlines does): keep them escaped so one
# record stays on one physical line for every JSONL reader. Other non-ASCII text stays readable.
_LINE_BREAKERS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029", "\x1c": "\\u001c"}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            line = json.dumps(row, ensure_ascii=False)
            for raw, escaped in _LINE_BREAKERS.items():
                line = line.replace(raw, escaped)
            fh.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--n-grpo", type=int, default=600)
    parser.add_argument("--out", default="data/embedded")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = instruction_dataset(args.seed, args.n_train, args.n_eval)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", held_out)
    prompts = grpo_prompts(args.seed, args.n_grpo, args.n_eval)
    write_jsonl(out / "grpo.jsonl", prompts)
    pairs_train, pairs_eval = preference_pairs(args.seed)
    write_jsonl(out / "pairs_train.jsonl", pairs_train)
    write_jsonl(out / "pairs_eval.jsonl", pairs_eval)
    print(
        f"wrote {len(train)} train, {len(held_out)} eval and {len(prompts)} GRPO prompt records, "
        f"{len(pairs_train)} train and {len(pairs_eval)} eval preference pairs to {out}"
    )


if __name__ == "__main__":
    main()
