"""Spike forensics and quarantine with a real tiny Trainer (issue 16, parts 3-4).

The poison is data-driven and reproducible: a forward hook on the LM head multiplies (or NaNs) the logits at the
positions whose input token is `MAGIC`, and only the poisoned record holds that token. So the record's own loss is
huge (or NaN), the step is skipped by the skip guard, and a re-run of the batch reproduces it - as a garbage record
would.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
from guards_common import tiny_lora_llama, training_args  # noqa: E402

from hf_stable.callbacks.forensics import ForensicsConfig, SpikeForensics  # noqa: E402
from hf_stable.callbacks.guards import SkipGuard  # noqa: E402
from hf_stable.data.collators import PackingCollator, PaddingCollator  # noqa: E402
from hf_stable.data.identity import RecordInfo, RecordTable  # noqa: E402
from hf_stable.forensics.quarantine import read_quarantine  # noqa: E402
from hf_stable.trainer import StableTrainer  # noqa: E402

MAGIC = 127
N, BATCH, SEED = 32, 4, 0


def _rows(poison_index: int):
    g = torch.Generator().manual_seed(5)
    rows = []
    for k in range(N):
        length = int(torch.randint(8, 14, (1,), generator=g))
        start = int(torch.randint(0, 120, (1,), generator=g))
        ids = ((start + torch.arange(length)) % 120).tolist()
        if k == poison_index:
            ids = [ids[0]] + [MAGIC] * (length - 1)
        rows.append({"input_ids": ids, "labels": [-100, -100] + ids[2:], "record_id": k})
    return rows


def _position_of(step: int, slot: int = 1) -> int:
    """The dataset index the quarantine sampler yields at `slot` of 1-based `step` in epoch 0."""
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    return perm[(step - 1) * BATCH + slot]


def poison(model, factor: float):
    seen = {}
    model.register_forward_pre_hook(lambda m, a, kw: seen.update(ids=kw.get("input_ids")), with_kwargs=True)

    def hook(module, args, out):
        ids = seen.get("ids")
        if ids is None or ids.shape != out.shape[:-1]:
            return out
        hit = (ids == MAGIC)[..., None]
        bad = out * factor if math.isfinite(factor) else torch.full_like(out, factor)
        return torch.where(hit, bad, out)

    model.base_model.model.lm_head.register_forward_hook(hook)


def _table():
    return RecordTable([RecordInfo(f"train.jsonl:{k + 1}", f"h{k:02d}", f"row {k}") for k in range(N)])


def _run(tmp_path, packing, factor, mode="auto", steps=16, poison_step=6, **kw):
    from datasets import Dataset

    idx = _position_of(poison_step)
    ds = Dataset.from_list(_rows(idx))
    collator = (PackingCollator(0, max_row_tokens=28, return_record_ids=True) if packing
                else PaddingCollator(0, return_record_ids=True))
    model = tiny_lora_llama()
    poison(model, factor)
    skip = SkipGuard(window=20, warmup_steps=3)
    forensics = SpikeForensics(ForensicsConfig(quarantine=mode, **kw), _table()).attach([skip])
    args = training_args(tmp_path, max_steps=steps, per_device_train_batch_size=BATCH, remove_unused_columns=False,
                         learning_rate=1e-3)
    trainer = StableTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                            callbacks=[skip, forensics])
    trainer.train()
    return trainer, skip, forensics, idx


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("factor", [float("nan"), 60.0])
def test_bad_step_names_the_poisoned_line_and_it_is_never_sampled_again(tmp_path, packing, factor):
    trainer, skip, forensics, idx = _run(tmp_path, packing, factor)
    assert skip.skipped_steps == [6]  # skipped once: epoch 2 (steps 9-16) never sees the record again
    entries = read_quarantine(tmp_path)
    assert [e["where"] for e in entries] == [f"train.jsonl:{idx + 1}"]
    e = entries[0]
    assert e["step"] == 6 and e["reason"] == ("nonfinite_loss" if math.isnan(factor) else "loss_outlier")
    assert e["hash"] == f"h{idx:02d}" and e["preview"] == f"row {idx}"
    if not math.isnan(factor):
        assert e["evidence"]["z"] > 4 and e["evidence"]["loss"] > 2 * e["evidence"]["reference_median"]
        assert e["evidence"]["grad_norm"] > 0
    kinds = [ev["kind"] for ev in forensics.events]
    assert kinds.count("samples_quarantined") == 1 and "step_forensics" in kinds
    assert forensics.sampler is not None and forensics.sampler.epoch == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_report_mode_writes_the_file_but_keeps_training_on_it(tmp_path):
    trainer, skip, forensics, idx = _run(tmp_path, False, float("nan"), mode="report")
    assert [e["where"] for e in read_quarantine(tmp_path)] == [f"train.jsonl:{idx + 1}"]
    assert len(skip.skipped_steps) == 2  # seen again in epoch 2 (and skipped again), no second entry
    assert forensics.sampler is None
