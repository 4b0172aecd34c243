"""Files that ship inside the package: the default recipe, the model card template, the embedded dataset.

They are package data read through `importlib.resources`, so an installed wheel finds them without the source
checkout. The checkout's `configs/default.yaml`, `model_cards/template.md` and `data/embedded/` are symlinks to these
files (one copy). A data path `embedded:<name>` (`data.train_file: embedded:train`) names a packaged JSONL file, so
the default recipe runs from any working directory.
"""

from __future__ import annotations

import atexit
from contextlib import ExitStack
from importlib.resources import as_file, files
from pathlib import Path

EMBEDDED_DATASETS = ("train", "eval", "grpo", "pairs_train", "pairs_eval")  # grpo: GRPO prompts; pairs_*: DPO

# A zipped install extracts a resource to a temporary file that must outlive the call: closed at exit.
_extracted = ExitStack()
atexit.register(_extracted.close)


def package_file(*parts: str) -> Path:
    """A file shipped in the `hf_stable` package, as a real path (for a plain install: the file itself)."""
    ref = files("hf_stable")
    for part in parts:
        ref = ref / part
    return _extracted.enter_context(as_file(ref))


def embedded_data_paths() -> list[str]:
    """The data paths that name packaged datasets: `embedded:train`, `embedded:eval`, `embedded:pairs_train`, ...."""
    from hf_stable.config.model import EMBEDDED_PREFIX  # config imports this module: resolved at call time

    return [f"{EMBEDDED_PREFIX}{name}" for name in EMBEDDED_DATASETS]


def embedded_dataset_name(path: str | Path | None) -> str | None:
    """`'train'` for `'embedded:train'`; None for a path that does not use the `embedded:` prefix."""
    from hf_stable.config.model import EMBEDDED_PREFIX

    text = str(path or "")
    return text[len(EMBEDDED_PREFIX) :] if text.startswith(EMBEDDED_PREFIX) else None


def data_file(path: str | Path) -> Path | None:
    """The file a data path names: `embedded:<name>` is packaged, anything else is used as given.

    Returns None for an `embedded:` name that does not exist (the caller names its config field in the error).
    """
    name = embedded_dataset_name(path)
    if name is None:
        return Path(path)
    if name not in EMBEDDED_DATASETS:
        return None
    return package_file("embedded", "data", f"{name}.jsonl")
