"""A skipped DPO / KTO step names its records (`hf_stable.stabilize`, `forensics.pairs`, `PairForensics`), on the
real TRL trainers: the record index survives TRL's tokenization and its over-long-prompt filter, reaches the step
through the collator. The skipped swapped-pair step naming its pairs (`step_pairs`, `skipped_pairs.jsonl`, by
``file:line``) is checked on the swapped-batch run of tests/test_posttrain_trl.py (one run for both)."""

from __future__ import annotations

import pytest

import hf_stable
from hf_stable.core.step_tap import RECORD_IDS_KEY
from hf_stable.forensics.pairs import PAIR_COLUMN, PairIdsCollator, record_places
from tests.dist_scripts.posttrain_common import build_trainer, kto_rows, preference_rows

pytest.importorskip("trl")


def test_the_record_index_survives_trls_filter_and_reaches_the_batch(tmp_path):
    rows = preference_rows(12)
    rows[2]["prompt"] = "count up " + " ".join(["1"] * 40)  # its prompt alone fills max_length: TRL drops it
    trainer = build_trainer("dpo", tmp_path, data=rows, max_steps=1, train_sampling_strategy="sequential")
    assert len(trainer.train_dataset) == 11
    hf_stable.stabilize(trainer)
    assert trainer.train_dataset[PAIR_COLUMN] == [0, 1, *range(3, 12)]  # the user's indices, row 2 left out
    assert isinstance(trainer.data_collator, PairIdsCollator) and trainer.data_collator.return_record_ids
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch[RECORD_IDS_KEY].tolist() == [0, 1, 3, 4]
    assert set(batch) >= {"input_ids", "attention_mask", "completion_mask"}
    trainer.train()  # the key is taken out before TRL's compute_loss sees the batch
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1]


def test_a_kto_batch_carries_its_record_indices(tmp_path):
    trainer = hf_stable.stabilize(build_trainer("kto", tmp_path, data=kto_rows(8), max_steps=1))
    batch = next(iter(trainer.get_train_dataloader()))
    assert sorted(batch[RECORD_IDS_KEY].tolist()) == sorted(set(batch[RECORD_IDS_KEY].tolist()))
    assert set(batch[RECORD_IDS_KEY].tolist()) <= set(range(8)) and len(batch[RECORD_IDS_KEY]) == 4


def test_record_places_reads_a_jsonl_files_non_empty_lines(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3}\n', encoding="utf-8")
    assert record_places(path) == ["pairs.jsonl:1", "pairs.jsonl:3", "pairs.jsonl:4"]
    assert record_places(["x:1", "y:2"]) == ["x:1", "y:2"] and record_places(None) is None
