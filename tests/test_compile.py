"""torch.compile: shape buckets bound the compilations, and bucket padding changes no loss or per-sample statistic."""

from __future__ import annotations

import pytest
import torch

from hf_stable.config import DataConfig
from hf_stable.config.loss import TrainingLossConfig
from hf_stable.data import PackingCollator, PaddingCollator, encode_records
from hf_stable.data.collators import shape_bucket_count, shape_multiple
from hf_stable.data.records import Record
from hf_stable.embedded.tasks import instruction_dataset
from hf_stable.forensics.sample_loss import chunk_sample_loss
from hf_stable.loss import chunked_training_forward
from tests.helpers import make_tiny_model


def _samples(tok, n=10, seed=5):
    rows, _ = instruction_dataset(seed, n_train=n, n_eval=0)
    recs = [Record(r, "mem.jsonl", i + 1) for i, r in enumerate(rows)]
    samples = encode_records(tok, recs, max_length=128)[0]
    for i, s in enumerate(samples):
        s["record_id"] = i
    return samples


def test_shape_multiple_rule():
    assert shape_multiple(None, None, torch_compile=False) is None  # eager: no bucket unless asked
    assert shape_multiple(None, None, torch_compile=True) == 32  # compiled: the default bucket
    assert shape_multiple(None, 0, torch_compile=True) is None  # 0 switches it off
    assert shape_multiple(8, None, torch_compile=False) == 8
    assert shape_multiple(24, 32, torch_compile=False) == 96  # both multiples honoured
    assert DataConfig(shape_buckets=-1).validate() == ["shape_buckets: got -1, must be >= 0 or null"]

    assert shape_bucket_count(PackingCollator(0, 32, max_row_tokens=128), 128) == 4
    assert shape_bucket_count(PackingCollator(0, 32, max_row_tokens=200), 128) == 7  # rows up to 200 tokens
    assert shape_bucket_count(PackingCollator(0, 32, max_row_tokens=None), 128) is None  # one row: unbounded
    assert shape_bucket_count(PaddingCollator(0, 64), 128) == 2
    assert shape_bucket_count(PaddingCollator(0), 128) is None


def test_buckets_give_few_lengths(tokenizer):
    samples = _samples(tokenizer, n=40)
    packer = PackingCollator(tokenizer.pad_token_id, 32, max_row_tokens=128)
    widths = {packer(samples[i : i + 6])["input_ids"].shape[1] for i in range(34)}
    plain = {
        PackingCollator(tokenizer.pad_token_id, max_row_tokens=128)(samples[i : i + 6])["input_ids"].shape[1]
        for i in range(34)
    }
    assert widths <= {32, 64, 96, 128} and len(plain) > len(widths)


@pytest.mark.parametrize("packing", [True, False])
def test_bucket_padding_changes_no_loss_and_no_per_sample_statistic(tokenizer_pad_eos, packing):
    """The training step's chunked loss, its gradients and each record's loss are the same with and without bucket
    padding (pad == eos: padding is masked by position, never by id)."""
    tok = tokenizer_pad_eos
    samples = _samples(tok)
    model = make_tiny_model("llama", tok).train()
    results = []
    for multiple in (None, 32):
        if packing:
            collator = PackingCollator(tok.pad_token_id, multiple, max_row_tokens=64, return_record_ids=True)
        else:
            collator = PaddingCollator(tok.pad_token_id, multiple, return_record_ids=True)
        batch = collator(samples)
        record_ids = batch.pop("record_ids")
        if multiple:
            assert batch["input_ids"].shape[1] % multiple == 0
        model.zero_grad()
        with chunked_training_forward(model, TrainingLossConfig()) as run:
            out = model(**batch, use_cache=False)
        assert run.calls == 1
        out.loss.backward()
        losses, counts = chunk_sample_loss(
            out.chunked, batch["labels"], batch.get("position_ids"), n_segments=record_ids.numel()
        )
        real = record_ids >= 0
        per_record = dict(zip(record_ids[real].tolist(), losses[real].tolist(), strict=True))
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        results.append((out.loss.item(), per_record, counts[real].tolist(), grads, batch["input_ids"].shape))
    (loss0, rec0, n0, g0, shape0), (loss1, rec1, n1, g1, shape1) = results
    assert shape1[1] > shape0[1]  # the bucket did pad
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert rec1.keys() == rec0.keys() == set(range(len(samples)))
    for rid in rec0:
        assert rec1[rid] == pytest.approx(rec0[rid], rel=1e-5)
    assert n1 == n0
    assert torch.allclose(g1, g0, rtol=1e-4, atol=1e-7)


def test_compile_monitor_logs_counts_and_warns_on_a_compilation_after_the_warm_up(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hf_stable.callbacks.monitors import CompileMonitor
    from hf_stable.compat import reset_dynamo

    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, logging_steps=1, report_to=[])
    state, control = TrainerState(), TrainerControl()
    reset_dynamo()
    monitor = CompileMonitor(warmup_steps=2)
    monitor.on_train_begin(args, state, control)
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    for step, n in enumerate([2, 2, 2, 3], start=1):  # compiled at step 1 (warm-up); a new length at step 4
        fn(torch.ones(n))
        state.global_step = step
        monitor.on_step_end(args, state, control)
    assert [(e["step"], e["kind"]) for e in monitor.events] == [(4, "recompile")]
    logs: dict = {}
    monitor.on_log(args, state, control, logs=logs)
    assert logs["compile/recompiles"] == 1.0 and logs["compile/most_of_one"] == 2.0
    assert logs["compile/frames_at_limit"] == 0.0

    eager = CompileMonitor()  # not compiled: nothing logged
    eager.on_train_begin(TrainingArguments(output_dir=str(tmp_path), report_to=[]), state, control)
    eager.on_step_end(args, state, control)
    assert not eager.enabled and eager._pending == {}


@pytest.mark.slow
@pytest.mark.timeout(1800)  # inductor compiles the forward and backward a few times: minutes on 2 shared cores
def test_compiled_recipe_compiles_at_most_once_per_bucket(tmp_path):
    """The default recipe's pieces (StableTrainer, chunked loss, every monitor and the attention probe, packed rows of
    varied lengths) under ``training.torch_compile: true``: no function is compiled more often than there are shape
    buckets, none reaches dynamo's recompile limit, and the counts reach the logs (`CompileMonitor`)."""
    from transformers import set_seed

    from hf_stable.callbacks import build_callbacks
    from hf_stable.callbacks.guards import guard_training_overrides
    from hf_stable.compat import reset_dynamo
    from hf_stable.config import load_config, training_arguments
    from hf_stable.data import build_data
    from hf_stable.modeling import apply_lora, load_model, load_tokenizer, resolve_base
    from hf_stable.optim import build_optimizer, trainer_optimizer_arguments
    from hf_stable.trainer import StableTrainer
    from tests.helpers import make_workdir, tiny_args

    make_workdir(tmp_path)
    argv = tiny_args(tmp_path, "llama", "--training.torch_compile", "true", "--training.max_steps", "12")
    argv += ["--training.logging_steps", "4", "--evaluation.before", "false", "--data.max_length", "96"]
    cfg = load_config(argv=argv)
    args = training_arguments(
        cfg, remove_unused_columns=False, **guard_training_overrides(cfg.stability.guards, cfg.training)
    )
    base = resolve_base(cfg.model)
    tokenizer = load_tokenizer(cfg.model, base)
    data = build_data(cfg.data, tokenizer, batch_size=args.per_device_train_batch_size, torch_compile=True)
    widths = {data.collator(data.train_dataset.select(range(i, i + 8)))["input_ids"].shape for i in range(0, 56, 8)}
    buckets = shape_bucket_count(data.collator, cfg.data.max_length)
    assert buckets == 3 and len(widths) > 1  # rows of <= 96 tokens in multiples of 32; the batches' shapes vary
    set_seed(0)
    model = apply_lora(load_model(cfg, base), cfg.lora)
    trainer = StableTrainer(
        model=model,
        args=args,
        train_dataset=data.train_dataset,
        data_collator=data.collator,
        processing_class=tokenizer,
        callbacks=build_callbacks(cfg, args, records=data.records),
        training_loss=cfg.training_loss,
        **trainer_optimizer_arguments(build_optimizer(model, cfg.optim, args), cfg.optim, args),
    )
    reset_dynamo()
    trainer.train()
    logged = [h for h in trainer.state.log_history if "compile/compiles" in h]
    assert logged, "no compile/* metric in the logs"
    last = logged[-1]
    assert last["compile/compiles"] >= 1  # it did compile
    assert last["compile/frames_at_limit"] == 0
    assert last["compile/most_of_one"] <= buckets, last
