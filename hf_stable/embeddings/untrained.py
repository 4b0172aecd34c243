"""Find the template tokens whose embedding rows the base never trained.

A chat format hangs on a handful of special tokens (end of turn, role headers, EOS). Some bases never saw them in
pretraining: Llama-3 base's `<|eot_id|>` / header rows are near zero, a tokenizer extended for a template leaves its
new rows at their initialisation. With LoRA those rows stay frozen, so the model can neither read nor learn the token.

Rule, per matrix (the input embedding, and the lm_head when it is not tied to it): a row of a special token the
training samples contain is untrained when it is all zeros, when all its entries are equal (a constant init), when
it is identical to another such token's row (one shared init), or when its L2 norm is below a tenth of the median
norm of the ordinary rows *and* more than 4 robust standard deviations below it (median and 1.4826 x MAD of the log
norm over the ordinary rows: the tokenizer's regular, non-special tokens, all-zero rows left out). Both norm
conditions are required because a small base's ordinary rows spread widely (the embedded tiny Llama's log-norm MAD
is 0.45, its lowest ordinary row sits near z = -2; tiny Qwen3's near z = -3.9 at 0.67 x the median), while the
untrained rows the rule is for sit orders of magnitude below the rest. A row still at a random init with a normal
norm cannot be told apart from a trained one by its statistics and is not flagged. A row within 1% of the ordinary
rows' mean is a repaired one (the mean of many rows has a small norm, which the norm rule would flag again) and is
not flagged either.

Unsloth's `fix_untrained_tokens` and NeMo's embedding-row repair are the prior art this follows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

MATRICES = ("input_embedding", "lm_head")
Z_LIMIT = -4.0
NORM_FRACTION = 0.1
REPAIRED_TOLERANCE = 1e-2  # relative distance to the ordinary rows' mean under which a row counts as repaired


@dataclass
class FlaggedRow:
    """One untrained row: the token, the matrix it is in, why, and its numbers."""

    token_id: int
    token: str
    matrix: str
    reason: str
    norm: float
    z: float | None = None


@dataclass
class UntrainedTokens:
    """What the detector found, and what the recipe did about it.

    Args:
        candidates: {token id: token} of the special tokens the training samples contain (the ones checked).
        rows: the flagged rows.
        stats: per matrix: the ordinary rows' count, median norm and log-norm MAD the rule used.
        tied: the lm_head shares the input embedding (one matrix checked).
        mode: `model.untrained_tokens` ("repair", "train" or "ignore").
        repaired: True once the rows were set to the trained rows' mean (`repair`, and `train` as its start).
        written: {matrix: (ids, rows)} as the repair wrote them (what `save_repair` stores).
    """

    candidates: dict[int, str] = field(default_factory=dict)
    rows: list[FlaggedRow] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    tied: bool = True
    mode: str = "repair"
    repaired: bool = False
    written: dict = field(default_factory=dict, repr=False)

    @property
    def token_ids(self) -> list[int]:
        return sorted({r.token_id for r in self.rows})

    def ids_in(self, matrix: str) -> list[int]:
        return sorted({r.token_id for r in self.rows if r.matrix == matrix})

    def names(self) -> list[str]:
        return [self.candidates.get(i, str(i)) for i in self.token_ids]

    def describe(self) -> str:
        """One line per flagged token: which matrix rows and why."""
        parts = []
        for i in self.token_ids:
            why = ", ".join(
                f"{r.matrix} {r.reason} (norm {r.norm:.3g}{'' if r.z is None else f', z {r.z:.1f}'})"
                for r in self.rows
                if r.token_id == i
            )
            parts.append(f"{self.candidates.get(i, i)!s} (id {i}): {why}")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "repaired": self.repaired,
            "tokens": self.names(),
            "token_ids": self.token_ids,
            "checked": sorted(self.candidates.values()),
            "tied": self.tied,
            "rows": [asdict(r) for r in self.rows],
            "stats": {m: {k: v for k, v in s.items() if k != "mean"} for m, s in self.stats.items()},
        }


def special_token_ids(tokenizer) -> dict[int, str]:
    """{id: token} of the tokenizer's special and added tokens (template markers, EOS, BOS, pad)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    return {i: tokenizer.convert_ids_to_tokens(i) for i in sorted(ids) if i is not None and i >= 0}


def used_special_tokens(tokenizer, data) -> dict[int, str]:
    """The special tokens (plus the stop tokens) that the rendered train / eval samples contain."""
    specials = special_token_ids(tokenizer)
    for i in getattr(data, "stop_token_ids", None) or []:
        specials.setdefault(int(i), tokenizer.convert_ids_to_tokens(int(i)))
    wanted, found = set(specials), set()
    for ds in (data.train_dataset, data.eval_dataset):
        if ds is None:
            continue
        for ids in ds["input_ids"]:
            found |= wanted.intersection(ids)
            if found == wanted:  # every sample carries the template's tokens: a few rows answer it
                break
    return {i: specials[i] for i in sorted(found)}


def _ordinary_rows(n_rows: int, n_tokens: int, specials) -> list[int]:
    skip = set(specials)
    # rows past the tokenizer's length are padding the vocabulary up to a multiple: never tokens, often zero
    return [i for i in range(min(n_rows, n_tokens)) if i not in skip]


def row_statistics(weight, ordinary: list[int]) -> dict:
    """Median norm and log-norm MAD of the ordinary rows (all-zero ones left out), and their mean (float32)."""
    import torch

    rows = weight.detach()[torch.tensor(ordinary, dtype=torch.long, device=weight.device)].float()
    norms = rows.norm(dim=1)
    keep = norms > 0
    rows, norms = rows[keep], norms[keep]
    if not len(norms):
        return {"n_rows": 0, "median_norm": 0.0, "log_norm_mad": 0.0, "mean": None}
    log = norms.log()
    median = log.median()
    mad = 1.4826 * (log - median).abs().median()
    return {
        "n_rows": len(norms),
        "median_norm": float(median.exp()),
        "log_norm_mad": float(mad),
        "mean": rows.mean(dim=0).cpu(),
    }


def flag_rows(weight, candidates: dict[int, str], stats: dict, matrix: str) -> list[FlaggedRow]:
    """The candidate rows of `weight` the module's rule calls untrained."""
    out: list[FlaggedRow] = []
    seen: dict[bytes, int] = {}
    median, mad = stats["median_norm"], max(stats["log_norm_mad"], 1e-6)
    mean = stats.get("mean")
    for i, token in candidates.items():
        if i >= weight.shape[0]:
            continue
        row = weight.detach()[i].float().cpu()
        norm = float(row.norm())
        z = (math.log(norm) - math.log(median)) / mad if norm > 0 and median else None
        peak = float(row.abs().max())
        if mean is not None and peak > 0 and float((row - mean).norm()) <= REPAIRED_TOLERANCE * float(mean.norm()):
            continue  # already repaired (a merged export of a repaired run): the mean's norm is low by nature
        if peak == 0:
            reason = "all zeros"
        elif row.numel() > 1 and float(row.max() - row.min()) <= 1e-6 * peak:
            reason = "constant (every entry equal)"
        elif row.numpy().tobytes() in seen:
            reason = f"identical to {candidates[seen[row.numpy().tobytes()]]}"
        elif median and norm < NORM_FRACTION * median and z is not None and z < Z_LIMIT:
            reason = f"norm {norm / median:.2g} x the ordinary rows' median"
        else:
            seen[row.numpy().tobytes()] = i
            continue
        seen.setdefault(row.numpy().tobytes(), i)
        out.append(FlaggedRow(i, token, matrix, reason, norm, None if z is None else round(z, 2)))
    return out


def embedding_matrices(model) -> dict[str, object]:
    """{"input_embedding": weight, "lm_head": weight (only when untied)} of a transformers model (PEFT unwrapped)."""
    model = getattr(model, "get_base_model", lambda: model)()
    emb = model.get_input_embeddings()
    out = {"input_embedding": getattr(emb, "base_layer", emb).weight}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        weight = getattr(head, "base_layer", head).weight
        if weight.data_ptr() != out["input_embedding"].data_ptr():
            out["lm_head"] = weight
    return out


def find_untrained_tokens(matrices: dict, tokenizer, candidates: dict[int, str], mode: str = "repair"):
    """Apply the rule to every matrix in `matrices` (`embedding_matrices(model)`, or rows read from disk).

    Args:
        matrices: {"input_embedding": tensor, "lm_head": tensor when untied}.
        tokenizer: the run's tokenizer (its special tokens are left out of the ordinary rows).
        candidates: {id: token} to check (`used_special_tokens`).
        mode: recorded in the result (`model.untrained_tokens`).

    Returns:
        An `UntrainedTokens`; its `stats[matrix]["mean"]` is the trained rows' mean a repair writes.

    Example:
        >>> found = find_untrained_tokens(embedding_matrices(model), tok, used_special_tokens(tok, data))
        >>> found.names()
        ['<|eot_id|>']
    """
    specials = special_token_ids(tokenizer)
    result = UntrainedTokens(candidates=dict(candidates), tied="lm_head" not in matrices, mode=mode)
    for matrix, weight in matrices.items():
        if weight is None or weight.numel() == 0:  # a partitioned (ZeRO-3) weight: nothing to read here
            continue
        stats = row_statistics(weight, _ordinary_rows(weight.shape[0], len(tokenizer), specials))
        result.stats[matrix] = stats
        if stats["n_rows"]:
            result.rows += flag_rows(weight, candidates, stats, matrix)
    return result
