"""Untrained template rows: what `model.untrained_tokens: repair` buys over `ignore` on a base with a zeroed
end-of-turn token.

    OMP_NUM_THREADS=1 python benchmarks/untrained_rows.py [--steps 150] [--exact-match 64] [--work DIR]

The embedded default base (`embedded:tiny-llama`, built or taken from the cache) is copied and its end-of-turn token's
rows (`<|end_of_text|>`: the input embedding and the untied lm_head) set to zero, the Llama-3-base situation. The
default recipe then trains on the embedded data for `--steps` steps, once with `repair` and once with `ignore`;
eval loss and exact match (greedy, stopping at the end-of-turn token) come from each run's `run_summary.json`, and
the report prints them side by side with their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def broken_base(work: Path) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    from hf_stable.config.model import EmbeddedBaseConfig
    from hf_stable.embedded.builder import ensure_base

    dst = work / "base-zeroed-eot"
    if not dst.exists():
        shutil.copytree(ensure_base("llama", EmbeddedBaseConfig()), dst)
        eot = PreTrainedTokenizerFast.from_pretrained(dst / "tokenizer").eos_token_id
        weights = load_file(dst / "model.safetensors")
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name][eot] = 0
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def run(base: Path, mode: str, work: Path, steps: int, exact_match: int) -> dict:
    out = work / f"run-{mode}"
    args = ["--model.name_or_path", str(base), "--model.untrained_tokens", mode, "--training.max_steps", str(steps)]
    args += ["--evaluation.exact_match_samples", str(exact_match), "--training.output_dir", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/finetune.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "run_summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--exact-match", type=int, default=64)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--modes", default="repair,train,ignore")
    a = parser.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="untrained_rows_"))
    work.mkdir(parents=True, exist_ok=True)
    base = broken_base(work)
    rows = {mode: run(base, mode, work, a.steps, a.exact_match) for mode in a.modes.split(",")}
    print(f"base: embedded:tiny-llama with <|end_of_text|> rows zeroed; {a.steps} steps, {a.exact_match} EM prompts")
    print(f"{'':>8} {'eval loss before':>17} {'eval loss after':>16} {'exact match before':>19} {'after':>7}")
    for mode, s in rows.items():
        print(
            f"{mode:>8} {s['eval_loss_before']:>17.4f} {s['eval_loss_after']:>16.4f} "
            f"{s['exact_match_before']:>19.3f} {s['exact_match_after']:>7.3f}"
        )
    r, i = rows["repair"], rows["ignore"]
    print(f"eval loss after, repair / ignore: {r['eval_loss_after'] / i['eval_loss_after']:.3f}")
    print(json.dumps({m: {k: s[k] for k in ("eval_loss_after", "exact_match_after")} for m, s in rows.items()}))


if __name__ == "__main__":
    main()
