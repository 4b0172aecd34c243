"""Task families with checkable answers, in English and Chinese, for the embedded default.

The same generators produce (a) the plain-text pretraining corpus of the tiny base model and (b) the
alpaca-format instruction dataset (`scripts/make_dataset.py`). Every answer is computed, so exact
match on held-out prompts is meaningful.
"""

from __future__ import annotations

import random
from collections.abc import Callable

EN_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "light",
    "paper",
    "music",
    "table",
    "window",
    "garden",
    "orange",
    "silver",
    "tiger",
    "bread",
    "candle",
    "forest",
    "rocket",
    "planet",
    "summer",
    "winter",
    "yellow",
    "purple",
    "mirror",
    "bridge",
    "castle",
    "dragon",
    "pencil",
    "rabbit",
    "violin",
    "coffee",
    "butter",
    "lemon",
    "ocean",
    "desert",
    "island",
    "valley",
    "market",
    "school",
]
ZH_WORDS = [
    "苹果",
    "香蕉",
    "河流",
    "石头",
    "白云",
    "绿色",
    "阳光",
    "纸张",
    "音乐",
    "桌子",
    "窗户",
    "花园",
    "老虎",
    "面包",
    "蜡烛",
    "森林",
    "火箭",
    "星球",
    "夏天",
    "冬天",
    "镜子",
    "桥梁",
    "城堡",
    "铅笔",
    "兔子",
    "咖啡",
    "海洋",
    "沙漠",
    "岛屿",
    "山谷",
    "市场",
    "学校",
]

EN_POS = [
    "love",
    "great",
    "wonderful",
    "happy",
    "excellent",
    "enjoy",
    "delightful",
    "amazing",
    "brilliant",
    "pleasant",
]
EN_NEG = ["hate", "awful", "terrible", "sad", "boring", "dislike", "horrible", "painful", "dreadful", "annoying"]
EN_SUBJ = [
    "this movie",
    "the food",
    "my new phone",
    "the weather",
    "that book",
    "the concert",
    "our hotel",
    "the game",
    "this song",
    "the trip",
    "the new app",
    "her painting",
    "the lecture",
    "this coffee",
    "the service",
    "that show",
]
ZH_POS = ["喜欢", "很好", "精彩", "开心", "满意", "优秀", "美好", "愉快"]
ZH_NEG = ["讨厌", "很差", "无聊", "难过", "失望", "糟糕", "痛苦", "烦人"]
ZH_SUBJ = [
    "这部电影",
    "这家餐厅",
    "我的新手机",
    "今天的天气",
    "那本书",
    "这场音乐会",
    "这家酒店",
    "这个游戏",
    "这首歌",
    "这次旅行",
    "这个软件",
    "这门课",
]

UNITS_EN = [("km", "m", 1000), ("kg", "g", 1000), ("m", "cm", 100), ("hours", "minutes", 60), ("L", "mL", 1000)]
UNITS_ZH = [
    ("千米", "米", 1000),
    ("千克", "克", 1000),
    ("米", "厘米", 100),
    ("小时", "分钟", 60),
    ("升", "毫升", 1000),
]

Example = dict  # {"family", "lang", "instruction", "input", "output", "fact"}


def _arith(rng: random.Random, lang: str) -> Example:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    if lang == "en":
        return {
            "instruction": f"What is {a} + {b}?",
            "input": "",
            "output": str(a + b),
            "fact": f"{a} + {b} = {a + b}.",
        }
    return {
        "instruction": f"计算 {a} 加 {b} 等于多少？",
        "input": "",
        "output": str(a + b),
        "fact": f"{a} 加 {b} 等于 {a + b}。",
    }


def _reverse(rng: random.Random, lang: str) -> Example:
    if lang == "en":
        w = rng.choice(EN_WORDS) if rng.random() < 0.3 else rng.choice(EN_WORDS) + rng.choice(EN_WORDS)[:3]
        return {
            "instruction": "Reverse the letters of the word.",
            "input": w,
            "output": w[::-1],
            "fact": f"{w} reversed is {w[::-1]}.",
        }
    w = rng.choice(ZH_WORDS) + rng.choice(ZH_WORDS)
    return {
        "instruction": "把下面的词语倒过来写。",
        "input": w,
        "output": w[::-1],
        "fact": f"{w} 倒过来是 {w[::-1]}。",
    }


def _convert(rng: random.Random, lang: str) -> Example:
    n = rng.randint(1, 99)
    if lang == "en":
        src, dst, k = rng.choice(UNITS_EN)
        out = f"{n * k} {dst}"
        return {
            "instruction": f"Convert {n} {src} to {dst}.",
            "input": "",
            "output": out,
            "fact": f"{n} {src} is {out}.",
        }
    src, dst, k = rng.choice(UNITS_ZH)
    out = f"{n * k} {dst}"
    return {
        "instruction": f"把 {n} {src} 换算成{dst}。",
        "input": "",
        "output": out,
        "fact": f"{n} {src} 等于 {out}。",
    }


def _sentiment(rng: random.Random, lang: str) -> Example:
    positive = rng.random() < 0.5
    if lang == "en":
        word = rng.choice(EN_POS if positive else EN_NEG)
        adverb = rng.choice(("", "really ", "truly ", "so "))
        if word in ("love", "hate", "enjoy", "dislike"):
            text = f"I {adverb}{word} {rng.choice(EN_SUBJ)}"
        else:
            text = f"{rng.choice(EN_SUBJ).capitalize()} is {adverb.replace('truly ', 'very ')}{word}"
        label = "positive" if positive else "negative"
        return {
            "instruction": "Classify the sentiment as positive or negative.",
            "input": text,
            "output": label,
            "fact": f'"{text}" is {label}.',
        }
    word = rng.choice(ZH_POS if positive else ZH_NEG)
    text = f"{rng.choice(ZH_SUBJ)}{rng.choice(('让人觉得', '真的', '实在', '总是'))}{word}"
    label = "正面" if positive else "负面"
    return {
        "instruction": "判断这句话的情感是正面还是负面。",
        "input": text,
        "output": label,
        "fact": f"“{text}”是{label}的。",
    }


FAMILIES: dict[str, Callable[[random.Random, str], Example]] = {
    "arithmetic": _arith,
    "reversal": _reverse,
    "unit_conversion": _convert,
    "sentiment": _sentiment,
}


def sample(rng: random.Random) -> Example:
    family = rng.choice(sorted(FAMILIES))
    lang = "en" if rng.random() < 0.6 else "zh"
    ex = FAMILIES[family](rng, lang)
    ex.update(family=family, lang=lang)
    return ex


def pretraining_corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Plain-text statements of the task facts: what the base model knows before instruction tuning."""
    rng = random.Random(seed)
    return [sample(rng)["fact"] for _ in range(n_lines)]


def _dirty(ex: Example, rng: random.Random) -> Example:
    """Deliberately dirty variants the data pipeline must clean: zero-width / control chars, no trailing newline."""
    r = rng.random()
    if r < 0.05:
        field_ = "input" if ex["input"] else "instruction"
        s = ex[field_]
        i = rng.randint(0, len(s))
        ex[field_] = s[:i] + rng.choice(["\u200b", "\ufeff", "\u200d", "\u2060"]) + s[i:]
    elif r < 0.08:
        ex["instruction"] = ex["instruction"] + rng.choice(["\x07", "\x1b", "\x00", "\x85"])
    return ex


def instruction_dataset(seed: int, n_train: int = 2000, n_eval: int = 200) -> tuple[list[dict], list[dict]]:
    """Alpaca records (instruction, input, output) plus `family`/`lang`; eval prompts never appear in train."""
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    eval_rows: list[dict] = []
    while len(eval_rows) < n_eval:
        ex = sample(rng)
        key = (ex["instruction"], ex["input"])
        if key in seen:
            continue
        seen.add(key)
        eval_rows.append({k: ex[k] for k in ("instruction", "input", "output", "family", "lang")})
    train_rows: list[dict] = []
    while len(train_rows) < n_train:
        ex = sample(rng)
        key = (ex["instruction"], ex["input"])
        if key in seen:  # held out, or already in train: no exact duplicates
            continue
        seen.add(key)
        ex = _dirty(ex, rng)
        # most outputs end with a newline; ~1 in 10 does not (a dirty case the collator must handle)
        if rng.random() < 0.9:
            ex["output"] += "\n"
        train_rows.append({k: ex[k] for k in ("instruction", "input", "output", "family", "lang")})
    return train_rows, eval_rows


GRPO_FAMILIES = ("arithmetic", "reversal", "unit_conversion")


def grpo_prompts(seed: int, n: int = 600, n_eval: int = 200) -> list[dict]:
    """Prompts for the GRPO stage (`embedded:grpo`): clean records of the families with computed answers, each with
    the fields the rewards read (`answer`, `family`); never one of the held-out eval prompts of
    `instruction_dataset(seed, ..., n_eval)`, so exact match on the eval set stays held out."""
    _, eval_rows = instruction_dataset(seed, n_train=0, n_eval=n_eval)
    seen = {(r["instruction"], r["input"]) for r in eval_rows}
    rng = random.Random(seed + 1)
    rows: list[dict] = []
    while len(rows) < n:
        family = GRPO_FAMILIES[len(rows) % len(GRPO_FAMILIES)]  # balanced families
        lang = "en" if rng.random() < 0.6 else "zh"
        ex = FAMILIES[family](rng, lang)
        key = (ex["instruction"], ex["input"])
        if key in seen:
            continue
        seen.add(key)
        rows.append(
            {
                "instruction": ex["instruction"],
                "input": ex["input"],
                "answer": ex["output"],
                "family": family,
                "lang": lang,
            }
        )
    return rows
