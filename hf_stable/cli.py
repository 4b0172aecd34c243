"""`hf-stable` console command: subcommands dispatch to the module that owns them.

hf-stable audit DATA.jsonl --tokenizer DIR|HUB_ID|embedded:tiny-llama [--skip-bad] [--json]   (SFT records or DPO pairs)
hf-stable report OUTPUT_DIR
hf-stable doctor --config CONFIG.yaml [overrides] [--json]
hf-stable build-base [--arch llama|qwen2|qwen3]
hf-stable export RUN_DIR [--out DIR] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import importlib
import sys

from hf_stable.errors import HfStableError

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
SUBCOMMANDS = {
    "audit": (
        "hf_stable.data.audit_pairs",
        "main",
        "audit a JSONL dataset, SFT or preference pairs (cleaning, EOS, labels, padding, duplicates)",
    ),
    "report": ("hf_stable.reporting.report", "main", "render the stability report of an output dir"),
    "doctor": ("hf_stable.doctor", "main", "preflight checks: environment, config hazards, dry run"),
    "build-base": ("hf_stable.embedded.cli", "main", "build (or find cached) the tiny embedded base model"),
    "export": ("hf_stable.export.cli", "main", "merge a run's LoRA into its base and verify the checkpoint"),
}


def _usage() -> str:
    lines = ["usage: hf-stable <command> [args]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = SUBCOMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except HfStableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
