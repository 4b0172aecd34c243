"""Prompt records for the GRPO stage: JSONL lines with `instruction` (+ `input`) or `messages` (the conversation
before the answer) or a plain `prompt`, plus the fields the rewards read (`answer`, `family`, ...). Rendered with the
SFT stage's template (`hf_stable.data.prompt_text`), so the policy is asked exactly what SFT taught it to answer."""

from __future__ import annotations

import json
import random
from pathlib import Path

from hf_stable.data.cleaning import clean_text
from hf_stable.errors import DataError
from hf_stable.resources import data_file, embedded_dataset_name


def _path(path: str, config_field: str) -> Path:
    if embedded_dataset_name(path) is not None:
        found = data_file(path)
        if found is None:
            raise DataError(f"{config_field}: {path} is not a packaged dataset")
        return found
    found = Path(path).expanduser()
    if not found.is_file():
        raise DataError(f"{config_field}: {path} not found (a JSONL file of prompts)")
    return found


def _check(obj, where: str) -> str | None:
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object, got {type(obj).__name__}"
    if isinstance(obj.get("instruction"), str) and obj["instruction"].strip():
        return None
    if isinstance(obj.get("messages"), list) and obj["messages"]:
        return None
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return None
    return f"{where}: no prompt: a record needs 'instruction' (+ 'input'), 'messages' or 'prompt'"


def read_prompts(path: str, *, on_bad_record: str = "error", clean: bool = True, config_field="data.train_file"):
    """The prompt records of a JSONL file, each with `_where` ('file:line').

    Raises:
        DataError: a bad line (with `on_bad_record: error`), or a file without one good record.
    """
    file = _path(path, config_field)
    rows, skipped = [], 0
    for n, line in enumerate(file.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            problem = f"{where}: not JSON ({e})"
        else:
            problem = _check(obj, where)
        if problem is not None:
            if on_bad_record == "error":
                raise DataError(f"{problem} (data.on_bad_record: skip skips such lines)")
            skipped += 1
            continue
        if clean:
            for key in ("instruction", "input", "prompt"):
                if isinstance(obj.get(key), str):
                    obj[key] = clean_text(obj[key])[0]
        obj["_where"] = where
        rows.append(obj)
    if not rows:
        raise DataError(f"{config_field}: {path} holds no usable prompt ({skipped} bad lines)")
    return rows


def split_prompts(rows: list[dict], n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): `n_eval` records chosen with `seed`, the rest in file order."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[: min(n_eval, len(rows) // 5)])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def render_prompt(tokenizer, record: dict, template: str) -> str:
    """The prompt text (special tokens written out) ending where the answer starts, as the SFT stage rendered it."""
    from hf_stable.data.prompts import prompt_text

    if "prompt" in record and "instruction" not in record and "messages" not in record:
        return record["prompt"]
    probe = dict(record)
    if "messages" in probe:
        probe["messages"] = [*probe["messages"], {"role": "assistant", "content": "x"}]
    else:
        probe["output"] = "x"
    return prompt_text(tokenizer, probe, template)


def reference(record: dict) -> str:
    """The answer exact match compares with: `answer`, or an SFT record's answer."""
    from hf_stable.data.prompts import reference_answer

    if "answer" in record:
        return clean_text(str(record["answer"]))[0].strip()
    return reference_answer(record)
