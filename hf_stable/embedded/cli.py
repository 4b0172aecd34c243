"""`hf-stable build-base`: build or locate the cached tiny base model."""

from __future__ import annotations

import argparse

from hf_stable.config.model import EMBEDDED_ARCHS, EmbeddedBaseConfig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-stable build-base")
    parser.add_argument("--arch", choices=EMBEDDED_ARCHS, default="llama")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--seed", type=int, default=EmbeddedBaseConfig.seed)
    args = parser.parse_args(argv)
    from hf_stable.embedded.builder import ensure_base

    print(ensure_base(args.arch, EmbeddedBaseConfig(seed=args.seed, cache_dir=args.cache_dir)))
    return 0
