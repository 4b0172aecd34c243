"""Record identity through the data pipeline, and the exact per-sample loss (issue 16, parts 1-2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from hf_stable.config.data import DataConfig
from hf_stable.core.step_tap import StepTap
from hf_stable.data import build_data
from hf_stable.data.collators import PackingCollator, PaddingCollator
from hf_stable.data.identity import read_exclusions, record_hash
from hf_stable.forensics.sample_loss import per_sample_loss
from hf_stable.trainer import StableTrainer
from tests.dist_scripts.guards_common import tiny_lora_llama, token_data, training_args


def _features(n=6, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        length = int(torch.randint(5, 12, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        labels = [-100] * 2 + ids[2:]
        out.append({"input_ids": ids, "labels": labels, "record_id": 100 + k})
    return out


def test_packed_record_ids_follow_position_id_restarts():
    feats = _features(7)
    batch = PackingCollator(0, pad_to_multiple_of=8, max_row_tokens=24, return_record_ids=True)(feats)
    pos = batch["position_ids"].reshape(-1).tolist()
    flat = batch["input_ids"].reshape(-1).tolist()
    starts = [i for i, p in enumerate(pos) if p == 0]
    ids = batch["record_ids"].tolist()
    assert len(ids) == len(starts)
    by_id = {f["record_id"]: f["input_ids"] for f in feats}
    for k, (s, rid) in enumerate(zip(starts, ids, strict=False)):
        end = starts[k + 1] if k + 1 < len(starts) else len(flat)
        if rid == -1:  # a tail padding segment
            continue
        assert flat[s:end][: len(by_id[rid])] == by_id[rid]
    assert sorted(i for i in ids if i >= 0) == sorted(by_id)


def test_padded_record_ids_one_per_row():
    feats = _features(4)
    batch = PaddingCollator(0, return_record_ids=True)(feats)
    assert batch["record_ids"].tolist() == [100, 101, 102, 103]
    assert "record_ids" not in PaddingCollator(0)(feats)


def _write(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


ROWS = [{"instruction": f"Add {i} and {i + 1}.", "input": "", "output": str(2 * i + 1)} for i in range(12)]


def test_exclude_file_by_line_and_hash_is_counted(tmp_path, tokenizer):
    train = _write(tmp_path / "train.jsonl", ROWS)
    excl = tmp_path / "quarantine.jsonl"
    excl.write_text(json.dumps({"where": f"{train}:3"}) + "\n" + json.dumps({"hash": record_hash(ROWS[6])}) + "\n")
    cfg = DataConfig(train_file=train, eval_file=None, exclude_file=str(excl), packing=False)
    data = build_data(cfg, tokenizer)
    assert len(data.train_dataset) == 10 and data.stats["train"]["dropped_reasons"] == {"excluded": 2}
    assert data.audit["train"]["dropped_reasons"]["excluded"] == 2
    kept = {data.records[r].where for r in data.train_dataset["record_id"]}
    assert f"{train}:3" not in kept and f"{train}:7" not in kept and f"{train}:4" in kept
    # the table names each sample's line, hash and a preview
    info = data.records[data.train_dataset["record_id"][0]]
    assert info.where == f"{train}:1" and info.hash == record_hash(ROWS[0]) and "Add 0 and 1" in info.preview


def test_exclude_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"where": "a.jsonl:1"}\n{"step": 3}\n')
    with pytest.raises(Exception, match=r"q.jsonl:2: names neither"):
        read_exclusions(str(bad))


class _Spy(TrainerCallback):
    """Forward pre-hook (kwargs) on the model: records every key the forward receives; per step, the record ids the
    tap kept with each micro-batch."""

    def __init__(self, model):
        self.keys: list[set] = []
        self.steps: list[list[list[int]]] = []
        self.tap = StepTap.shared(model).attach()
        model.register_forward_pre_hook(lambda m, a, kw: self.keys.append(set(kw)), with_kwargs=True)

    def on_step_begin(self, args, state, control, **kw):
        self.tap.begin_step()

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.steps.append([None if ids is None else ids.tolist() for ids in self.tap.record_ids])


@pytest.mark.parametrize("packing", [False, True])
def test_record_ids_reach_the_tap_never_the_forward(tmp_path, packing):
    g = torch.Generator().manual_seed(3)
    rows = []
    for k in range(16):
        ids = torch.randint(0, 128, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] + ids[1:], "record_id": 500 + k})
    from datasets import Dataset

    ds = Dataset.from_list(rows)
    collator = PackingCollator(0) if packing else PaddingCollator(0)  # StableTrainer asks for the ids
    model = tiny_lora_llama()
    spy = _Spy(model)
    args = training_args(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        remove_unused_columns=False,
    )
    StableTrainer(model=model, args=args, train_dataset=ds, data_collator=collator, callbacks=[spy]).train()
    assert spy.keys and all("record_ids" not in k and "record_id" not in k for k in spy.keys)
    assert len(spy.steps) == 2 and all(len(step) == 2 for step in spy.steps)  # 2 micro-batches per step
    seen = [i for step in spy.steps for mb in step for i in mb if i >= 0]
    assert len(seen) == 16 and sorted(seen) == list(range(500, 516))  # every record once, 2 steps x 2 x 4


def test_another_collators_record_ids_reach_the_model_untouched(tmp_path):
    """A collator that is not hf_stable's may carry a ``record_ids`` key of its own (a model or a custom
    compute_loss that reads it): StableTrainer leaves it in the batch, as the stock Trainer does."""
    from transformers.data.data_collator import default_data_collator

    def user_collator(features):
        batch = default_data_collator([{k: f[k] for k in ("input_ids", "labels")} for f in features])
        batch["record_ids"] = torch.tensor([f["record_id"] for f in features])
        return batch

    rows = [{**f, "record_id": 700 + k} for k, f in enumerate(token_data(16))]
    model = tiny_lora_llama()
    spy = _Spy(model)
    args = training_args(tmp_path, max_steps=2, per_device_train_batch_size=4, remove_unused_columns=False)
    StableTrainer(model=model, args=args, train_dataset=rows, data_collator=user_collator, callbacks=[spy]).train()
    assert len(spy.keys) == 2 and all("record_ids" in k for k in spy.keys)  # the user's key reached the forward
    assert all(step == [None] for step in spy.steps)  # and was not taken as hf_stable's forensics ids


def _alone(model, ids, labels):
    out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), use_cache=False)
    return float(out.loss)


@pytest.mark.parametrize("packing", [False, True])
def test_per_sample_loss_equals_each_sample_alone(packing):
    model = tiny_lora_llama(lora=False).eval()
    feats = _features(5, seed=4)
    if packing:
        batch = PackingCollator(0, max_row_tokens=20, return_record_ids=True)(feats)
    else:
        batch = PaddingCollator(0, return_record_ids=True)(feats)
    ids = batch.pop("record_ids")
    kw = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask", "position_ids")}
    with torch.no_grad():
        logits = model(**kw, use_cache=False).logits
        loss, count = per_sample_loss(logits, batch["labels"], batch.get("position_ids"), n_segments=len(ids))
        by_id = {f["record_id"]: f for f in feats}
        for rid, got, n in zip(ids.tolist(), loss.tolist(), count.tolist(), strict=False):
            if rid < 0:
                assert n == 0
                continue
            f = by_id[rid]
            want = _alone(model, f["input_ids"], f["labels"])
            assert n == sum(1 for x in f["labels"][1:] if x != -100)
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_audit_exclude_leaves_the_quarantined_records_out(tmp_path, tokenizer):
    from hf_stable.data.audit import audit_dataset, main

    train = _write(tmp_path / "train.jsonl", ROWS)
    q = tmp_path / "quarantine.jsonl"
    q.write_text(json.dumps({"where": f"{train}:2", "hash": record_hash(ROWS[1]), "step": 4}) + "\n")
    audit = audit_dataset(train, tokenizer, exclude=str(q))
    assert audit["n_kept"] == 11 and audit["dropped_reasons"] == {"excluded": 1}
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    assert main([train, "--tokenizer", str(tok_dir), "--exclude", str(q), "--json"]) == 0


def test_quarantine_off_survives_yaml_reading_it_as_false():
    from hf_stable.config import load_config

    assert load_config(argv=["--data.quarantine", "off"]).data.quarantine == "off"
    assert load_config(argv=[]).data.quarantine == "auto"  # the recipe's default


def test_judge_names_a_long_outlier_not_a_short_hard_answer_nor_a_batch_of_nans():
    from hf_stable.forensics.attribution import SampleRow, judge

    rows = [SampleRow(k, 2.0 + 0.1 * (k % 5), 6, float("nan"), 0) for k in range(15)]
    rows += [SampleRow(90, 6.5, 4, float("nan"), 0), SampleRow(91, 6.0, 60, float("nan"), 0)]
    culprits, _, median = judge(rows, None, zscore=5.0, min_rel=1.0, min_excess=25.0)
    assert [c.row.record_id for c in culprits] == [91] and median == 2.2  # 4 tokens at 3x: 17 nats, not enough
    nans = [SampleRow(k, float("nan"), 6, float("nan"), 0) for k in range(4)] + [SampleRow(9, 2.0, 6, 0.0, 0)]
    assert judge(nans, None, zscore=5.0, min_rel=1.0)[0] == []  # every sample NaN: the weights, not the data
    one = [SampleRow(k, 2.0, 6, float("nan"), 0) for k in range(5)] + [SampleRow(7, float("nan"), 6, 0.0, 0)]
    assert [(c.row.record_id, c.reason) for c in judge(one, None, zscore=5.0, min_rel=1.0)[0]] == [
        (7, "nonfinite_loss")
    ]


class _Bigram(torch.nn.Module):
    """Logits from the current token only: the context before a token changes nothing."""

    def __init__(self, vocab: int = 32):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids=None, use_cache=None, **_):
        return type("Out", (), {"logits": self.table(input_ids)})()


def test_prompt_gain_is_one_when_the_prompt_cannot_matter_and_ignores_padding():
    from hf_stable.forensics.attribution import prompt_gain

    torch.manual_seed(0)
    model = _Bigram()
    empty = [1, 2, 3]  # the template around an empty question; both prompts end with its last token
    ids = torch.tensor([[1, 9, 9, 5, 3, 7, 8, 11]])
    labels = torch.tensor([[-100] * 5 + [7, 8, 11]])
    gain = prompt_gain(model, {"input_ids": ids, "labels": labels}, empty)
    assert gain == pytest.approx(1.0, abs=1e-6)
    # the same sample as a right-padded row of a batch: padding (attention 0) is not part of it
    padded = {
        "input_ids": torch.cat([ids, torch.tensor([[0, 0, 0]])], 1),
        "labels": torch.cat([labels, torch.tensor([[-100] * 3])], 1),
        "attention_mask": torch.tensor([[1] * 8 + [0] * 3]),
    }
    assert prompt_gain(model, padded, empty) == pytest.approx(gain, abs=1e-6)
    # a prompt ending elsewhere predicts the answer's first token differently: the gain moves off 1
    other = torch.tensor([[1, 9, 9, 5, 4, 7, 8, 11]])
    assert prompt_gain(model, {"input_ids": other, "labels": labels}, empty) != pytest.approx(1.0, abs=1e-4)
    assert math.isnan(prompt_gain(model, {"input_ids": ids, "labels": torch.full_like(labels, -100)}, empty))


def test_an_earlier_runs_quarantine_is_set_aside_and_a_resume_rewrites_the_file_from_the_checkpoint(tmp_path):
    """A fresh run into a used output dir must not append to the earlier run's quarantine.jsonl; a resumed run
    names again what was named after its checkpoint, so the file is rewritten from the checkpoint's entries."""
    from hf_stable.forensics.quarantine import QUARANTINE_FILE, Entry, Quarantine, read_quarantine
    from hf_stable.outputs import OutputDir

    earlier = Quarantine("auto", str(tmp_path))
    earlier.add(Entry(record_id=3, where="train.jsonl:4", hash="h", step=2, reason="loss_outlier"))
    earlier.add(Entry(record_id=5, where="train.jsonl:6", hash="h", step=9, reason="loss_outlier"))
    OutputDir(tmp_path).set_aside_events(resuming=False)
    assert read_quarantine(tmp_path) == []
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("quarantine.") and p.name != QUARANTINE_FILE]
    assert len(aside) == 1 and len(read_quarantine(aside[0])) == 2  # set aside, not lost

    (tmp_path / QUARANTINE_FILE).write_text(aside[0].read_text())  # a run killed after step 9, checkpoint at 5
    resumed = Quarantine("auto")
    resumed.load_state_dict({"entries": [earlier.entries[0].to_dict()]})
    resumed.output_dir = str(tmp_path)
    resumed.rewrite()
    assert [e["where"] for e in read_quarantine(tmp_path)] == ["train.jsonl:4"]
    resumed.add(Entry(record_id=5, where="train.jsonl:6", hash="h", step=9, reason="loss_outlier"))  # named again
    assert [e["where"] for e in read_quarantine(tmp_path)] == ["train.jsonl:4", "train.jsonl:6"]  # once each
