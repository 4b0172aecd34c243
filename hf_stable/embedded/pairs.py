"""Preference pairs for the embedded DPO stage, built from the same task families as the SFT data.

Chosen is the computed answer; rejected is a plausible wrong one of the kind a half-trained model writes: a sum off
by a little, the word left unreversed or with two letters swapped, a conversion with the wrong factor, the opposite
sentiment. The prompt is the SFT record's user turn (`prompt_messages`), so a pair reaches the model exactly as the
SFT question did. Pairs never use a prompt of the SFT eval set (that set measures what DPO costs the SFT task), and
the train and eval pairs share no prompt. Deterministic: the same seed gives the same files byte for byte
(`scripts/make_dataset.py`).
"""

from __future__ import annotations

import random

from hf_stable.data.prompts import prompt_messages
from hf_stable.embedded.tasks import instruction_dataset, sample


def _swap_two(word: str, rng: random.Random) -> str:
    if len(word) < 2:
        return word + word
    i = rng.randrange(len(word) - 1)
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


def wrong_answer(ex: dict, rng: random.Random) -> str:
    """A plausible wrong answer to the task example `ex` (never equal to its output)."""
    right, family = ex["output"], ex["family"]
    if family == "arithmetic":
        value = int(right)
        deltas = [d for d in (-10, -2, -1, 1, 2, 10) if value + d > 0]
        return str(value + rng.choice(deltas))
    if family == "reversal":
        candidates = [ex["input"], _swap_two(right, rng)]
        candidates = [c for c in candidates if c != right] or [right + right[-1]]
        return rng.choice(candidates)
    if family == "unit_conversion":
        number, unit = right.split(" ", 1)
        n = int(number)
        factor = rng.choice((10, 100, 1000))
        wrong = n // factor if rng.random() < 0.5 and n >= factor else n * 10
        return f"{wrong} {unit}" if str(wrong) != number else f"{n + 1} {unit}"
    if family == "sentiment":
        return {"positive": "negative", "negative": "positive", "正面": "负面", "负面": "正面"}[right]
    raise ValueError(f"no wrong answers for family {family!r}")


def _pair(ex: dict, rng: random.Random) -> dict:
    rejected = wrong_answer(ex, rng)
    assert rejected != ex["output"], ex  # a generator bug, not user input
    return {
        "prompt": prompt_messages(ex)[0]["content"],
        "chosen": ex["output"],
        "rejected": rejected,
        "family": ex["family"],
        "lang": ex["lang"],
    }


def preference_pairs(seed: int, n_train: int = 1000, n_eval: int = 200) -> tuple[list[dict], list[dict]]:
    """(train pairs, eval pairs) as text pairs with ``family``/``lang``; no prompt of the SFT eval set (the
    `instruction_dataset(seed)` held-out rows) and none shared between train and eval."""
    _, sft_eval = instruction_dataset(seed)
    seen = {(r["instruction"], r["input"]) for r in sft_eval}
    rng = random.Random(f"pairs-{seed}")
    out: list[list[dict]] = [[], []]
    for rows, n in ((out[1], n_eval), (out[0], n_train)):
        while len(rows) < n:
            ex = sample(rng)
            key = (ex["instruction"], ex["input"])
            if key in seen:
                continue
            seen.add(key)
            rows.append(_pair(ex, rng))
    return out[0], out[1]
