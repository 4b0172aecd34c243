"""Batch collators: right-padded batches and padding-free packed batches.

Both take samples that already carry their labels (-100 on the prompt, see ``samples.py``) and only
add what batching needs. Padding is masked *by position* (the positions the collator appends), never
by comparing token ids with ``pad_token_id`` — with ``pad_token == eos_token`` an id-based mask would
hide every EOS and the model would never learn to stop.

Packing concatenates the batch into one row ``[1, total_tokens]`` (or, with ``max_row_tokens``, a few
balanced rows) with ``position_ids`` restarting at 0 for every sample, plus ``cu_seq_lens_q/k``
(int32 cumulative lengths) and ``max_length_q/k`` — the keys transformers' flash-attention varlen path
reads, as ``DataCollatorWithFlattening`` produces them. With ``sdpa``/``eager`` transformers rebuilds a
block-diagonal causal mask from the restarting ``position_ids`` when there is no ``attention_mask`` and
no KV cache, so the model must run with ``use_cache=False`` (the Trainer does; a hand-written loop must
pass it). The first label of every sample is -100 so the last token of one sample is never trained to
predict the next sample's first token; a padded batch never uses that label either (the loss shifts
labels by one), so packed and padded losses are equal.
"""

from __future__ import annotations

import math

from hf_stable.data.samples import IGNORE_INDEX
from hf_stable.errors import DataError


def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _record_id(feature) -> int:
    rid = feature.get("record_id") if hasattr(feature, "get") else None
    return -1 if rid is None else int(rid)


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


DEFAULT_SHAPE_BUCKET = 32  # `data.shape_buckets: null` under torch.compile


def shape_multiple(pad_to_multiple_of: int | None, shape_buckets: int | None, torch_compile: bool) -> int | None:
    """The multiple a batch's length is padded up to: ``data.pad_to_multiple_of`` and the shape bucket (``data.
    shape_buckets``; null: `DEFAULT_SHAPE_BUCKET` when training is compiled, else none; 0: none), both honoured.

    Why buckets: torch.compile guards on input shapes, and packed rows come out with a new length almost every step.
    Rounding lengths up to a multiple of 32 leaves ``ceil(max_length / 32)`` lengths (4 at the default 128) at a cost
    of under 32 pad positions per row (labels -100: the loss and every per-sample statistic are unchanged)."""
    bucket = (DEFAULT_SHAPE_BUCKET if torch_compile else 0) if shape_buckets is None else shape_buckets
    multiples = [m for m in (pad_to_multiple_of, bucket) if m]
    return math.lcm(*multiples) if multiples else None


def shape_bucket_count(collator, max_length: int) -> int | None:
    """How many batch lengths `collator` can produce for samples of at most `max_length` tokens (a packed row holds
    at most ``max(max_row_tokens, max_length)``); None when unbounded (one packed row of the whole batch) or
    unbucketed (every length up to the limit)."""
    multiple = getattr(collator, "pad_to_multiple_of", None)
    if isinstance(collator, PackingCollator):
        if not collator.max_row_tokens:
            return None
        max_length = max(max_length, collator.max_row_tokens)
    return -(-max_length // multiple) if multiple else None


def _check_supervised(n_supervised: int, n_samples: int) -> None:
    if n_supervised == 0:
        raise DataError(
            f"a batch of {n_samples} samples has no supervised token (every label is -100), which makes the loss "
            "NaN; build the dataset with hf_stable.data.build_data, which drops such samples"
        )


def pack_rows(lengths: list[int], max_row_tokens: int | None) -> list[list[int]]:
    """Sample indices per packed row: one row when `max_row_tokens` is falsy, else balanced rows.

    Uses as few rows as the token count allows (``ceil(total / max_row_tokens)``, more if the samples do not
    fit) and fills them longest-first into the least-loaded row, so rows come out nearly equal in length and
    the padding that evens them up stays small. A sample longer than `max_row_tokens` gets a row of its own.
    """
    if not max_row_tokens or not lengths:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    n_rows = max(1, -(-sum(lengths) // max_row_tokens))
    while True:
        rows: list[list[int]] = [[] for _ in range(n_rows)]
        load = [0] * n_rows
        for i in order:
            r = min(range(n_rows), key=load.__getitem__)
            rows[r].append(i)
            load[r] += lengths[i]
        if all(ld <= max_row_tokens or len(row) == 1 for ld, row in zip(load, rows, strict=False)) or n_rows >= len(
            lengths
        ):
            return [sorted(row) for row in rows if row]
        n_rows += 1


class PaddingCollator:
    """Right-pads samples into ``input_ids``/``attention_mask``/``labels`` tensors.

    Args:
        pad_token_id: id written into padding positions (may equal the EOS id: labels there are -100 by position).
        pad_to_multiple_of: round the padded length up to a multiple (tensor-core friendly shapes).
        padding_side: ``"right"`` (training) or ``"left"`` (batched generation).
        return_record_ids: also return ``record_ids`` (``[B]``, each row's ``record_id``, -1 when a feature has
            none); `StableTrainer` takes it out before the forward (see ``identity.py``).

    Raises:
        DataError: when a batch has no supervised token at all.

    Example:
        >>> batch = PaddingCollator(tok.pad_token_id)(train_dataset.select(range(4)))
        >>> batch["labels"].shape == batch["input_ids"].shape
        True
    """

    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        padding_side: str = "right",
        return_record_ids: bool = False,
    ):
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side: got {padding_side!r}, must be 'right' or 'left'")
        self.return_record_ids = return_record_ids
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_side = padding_side

    def __call__(self, features: list[dict]) -> dict:
        import torch

        rows = [_as_list(f["input_ids"]) for f in features]
        labels = [_as_list(f["labels"]) if "labels" in f else list(r) for f, r in zip(features, rows, strict=False)]
        width = _round_up(max(len(r) for r in rows), self.pad_to_multiple_of)
        ids_out, lab_out, mask_out, n_sup = [], [], [], 0
        for r, lab in zip(rows, labels, strict=False):
            extra = width - len(r)
            n_sup += sum(1 for x in lab if x != IGNORE_INDEX)
            if self.padding_side == "right":
                ids_out.append(r + [self.pad_token_id] * extra)
                lab_out.append(lab + [IGNORE_INDEX] * extra)
                mask_out.append([1] * len(r) + [0] * extra)
            else:
                ids_out.append([self.pad_token_id] * extra + r)
                lab_out.append([IGNORE_INDEX] * extra + lab)
                mask_out.append([0] * extra + [1] * len(r))
        _check_supervised(n_sup, len(rows))
        batch = {
            "input_ids": torch.tensor(ids_out, dtype=torch.long),
            "attention_mask": torch.tensor(mask_out, dtype=torch.long),
            "labels": torch.tensor(lab_out, dtype=torch.long),
        }
        if self.return_record_ids:
            batch["record_ids"] = torch.tensor([_record_id(f) for f in features], dtype=torch.long)
        return batch


class PackingCollator:
    """Concatenates a batch into padding-free packed rows with per-sample ``position_ids``.

    Args:
        pad_token_id: used only for the tail segment a row gets from ``pad_to_multiple_of`` or from being shorter
            than the longest row.
        pad_to_multiple_of: round the row length up; the tail is its own segment (positions restart, labels -100),
            so it never attends to or is attended by a real sample.
        max_row_tokens: None or 0 → the whole batch is one row ``[1, total]`` (as ``DataCollatorWithFlattening``;
            best with flash-attn varlen). N → samples are spread over as few balanced rows of at most N tokens as
            fit (see `pack_rows`; a longer sample gets a row of its own). With sdpa/eager the block-diagonal
            mask is dense, so attention costs ``rows x width²`` instead of ``(sum of lengths)²``: rows keep
            packing fast there (`benchmarks/packing.py`: 1.8x vs padded on CPU, one row: 1.3x).
        return_flash_attn_kwargs: also return ``cu_seq_lens_q/k`` (over the flattened rows, tail segments included)
            and ``max_length_q/k``.
        return_record_ids: also return ``record_ids``: one per segment of the flattened rows, in the order of the
            ``position_ids`` restarts (-1 for a tail padding segment); `StableTrainer` takes it out before the
            forward.

    Raises:
        DataError: when a batch has no supervised token at all.

    Example:
        >>> batch = PackingCollator()([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
        ...                            {"input_ids": [1, 4], "labels": [-100, 4]}])
        >>> batch["position_ids"].tolist(), batch["cu_seq_lens_q"].tolist()
        ([[0, 1, 2, 0, 1]], [0, 3, 5])
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        max_row_tokens: int | None = None,
        return_flash_attn_kwargs: bool = True,
        return_record_ids: bool = False,
    ):
        self.return_record_ids = return_record_ids
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_row_tokens = max_row_tokens
        self.return_flash_attn_kwargs = return_flash_attn_kwargs

    def __call__(self, features: list[dict]) -> dict:
        import torch

        samples = []
        n_sup = 0
        for f in features:
            r = _as_list(f["input_ids"])
            if r:
                lab = _as_list(f["labels"]) if "labels" in f else r
                n_sup += sum(1 for x in lab[1:] if x != IGNORE_INDEX)
                samples.append((r, lab, _record_id(f)))
        _check_supervised(n_sup, len(features))
        rows = pack_rows([len(r) for r, _, _ in samples], self.max_row_tokens)
        width = _round_up(max(sum(len(samples[i][0]) for i in row) for row in rows), self.pad_to_multiple_of)
        ids_out, lab_out, pos_out, seg_lens, seg_ids = [], [], [], [], []
        for row in rows:
            ids: list[int] = []
            labels: list[int] = []
            positions: list[int] = []
            for i in row:
                r, lab, rid = samples[i]
                seg_ids.append(rid)
                ids.extend(r)
                labels.append(IGNORE_INDEX)
                labels.extend(lab[1:])
                positions.extend(range(len(r)))
                seg_lens.append(len(r))
            extra = width - len(ids)
            if extra:
                ids.extend([self.pad_token_id] * extra)
                labels.extend([IGNORE_INDEX] * extra)
                positions.extend(range(extra))
                seg_lens.append(extra)
                seg_ids.append(-1)
            ids_out.append(ids)
            lab_out.append(labels)
            pos_out.append(positions)
        batch = {
            "input_ids": torch.tensor(ids_out, dtype=torch.long),
            "labels": torch.tensor(lab_out, dtype=torch.long),
            "position_ids": torch.tensor(pos_out, dtype=torch.long),
        }
        if self.return_record_ids:
            batch["record_ids"] = torch.tensor(seg_ids, dtype=torch.long)
        if self.return_flash_attn_kwargs:
            cu = [0]
            for n in seg_lens:
                cu.append(cu[-1] + n)
            cu_t = torch.tensor(cu, dtype=torch.int32)
            longest = max(seg_lens)
            batch.update(cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t.clone(), max_length_q=longest, max_length_k=longest)
        return batch
