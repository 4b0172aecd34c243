"""The chunked training loss (`hf_stable.loss`): the same loss and gradients as the model's own forward, and the
model's forward wherever logits are asked for."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen3Config, TrainerCallback

from hf_stable.config.loss import TrainingLossConfig
from hf_stable.core.step_tap import StepTap
from hf_stable.loss import chunked_cross_entropy, chunked_training_forward, unsupported_reason
from hf_stable.trainer import StableTrainer
from tests.dist_scripts.guards_common import tiny_lora_llama, token_data, training_args

V = 384
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen3_tied":
        config = Qwen3Config(vocab_size=V, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, **SMALL)
    elif kind == "gemma2_softcap":  # a cap of 2 bites on random-init logits (the usual 30 would be near-linear)
        config = Gemma2Config(vocab_size=V, num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0, **SMALL)
    else:
        config = LlamaConfig(vocab_size=V, num_key_value_heads=2, **SMALL)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    if kind == "llama_lora_head":
        lora["target_modules"] = ["q_proj", "v_proj", "lm_head"]
    if kind == "llama_saved_head":
        lora["modules_to_save"] = ["lm_head"]
    return get_peft_model(model, LoraConfig(**lora)).train()


def _batch(layout: str) -> dict:
    g = torch.Generator().manual_seed(3)
    if layout == "padded":  # right padding, prompts masked, rows of different lengths
        ids = torch.randint(0, V, (3, 14), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        mask[2, 5:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :3] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    lengths = [7, 11, 5]  # packed: one row, position_ids restart per sample, each sample's first label -100
    ids = torch.randint(0, V, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[pos == 0] = -100
    labels[0, 8:10] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def _loss_and_grads(model, batch, chunked: bool, **cfg):
    params = [p for p in model.parameters() if p.requires_grad]
    with chunked_training_forward(model, TrainingLossConfig(chunked=chunked, chunk_size=5, **cfg)) as run:
        out = model(**batch, use_cache=False)
    assert (run is not None and run.calls == 1) == chunked  # the path asked for is the path taken
    assert (out.logits is None) == chunked
    return out.loss.detach(), torch.autograd.grad(out.loss, params)


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=0)
    scale = max(g.abs().max().item() for g in grads_a)
    for ga, gb in zip(grads_a, grads_b, strict=True):  # atol: elements near zero, relative to the largest gradient
        torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("kind", ["llama_lora", "llama_lora_head", "llama_saved_head", "qwen3_tied", "gemma2_softcap"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_loss_and_gradients_equal_the_models_forward(kind, layout):
    model, batch = _model(kind), _batch(layout)
    assert unsupported_reason(model.get_base_model()) is None
    if kind == "qwen3_tied":
        base = model.get_base_model()
        assert base.lm_head.weight is base.model.embed_tokens.weight
    for items in (None, torch.tensor(40)):  # the model's mean, and the Trainer's sum / num_items_in_batch
        kw = {} if items is None else {"num_items_in_batch": items}
        _assert_same(_loss_and_grads(model, {**batch, **kw}, False), _loss_and_grads(model, {**batch, **kw}, True))


@pytest.fixture(scope="module")
def qlora_base(tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    from tests.qlora_helpers import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("qbase"))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_qlora_loss_and_gradients_equal_the_models_forward(qlora_base, layout):
    """A 4-bit NF4 base (bitsandbytes on CPU, fp32 compute) with LoRA, prepared for k-bit training and with
    non-reentrant gradient checkpointing as the QLoRA recipes run it; its fp32 lm_head is left unquantized."""
    from bitsandbytes.nn import Linear4bit

    from tests.dist_scripts.guards_common import VOCAB
    from tests.qlora_helpers import quantized_lora_llama

    model = quantized_lora_llama(qlora_base, gradient_checkpointing=True).train()
    assert sum(isinstance(m, Linear4bit) for m in model.modules()) == 14  # 7 projections x 2 layers, quantized
    assert model.get_base_model().is_gradient_checkpointing
    batch = _batch(layout)
    batch["input_ids"] = batch["input_ids"] % VOCAB
    batch["labels"] = torch.where(batch["labels"] == -100, -100, batch["labels"] % VOCAB)
    for items in (None, torch.tensor(40)):
        kw = {} if items is None else {"num_items_in_batch": items}
        _assert_same(_loss_and_grads(model, {**batch, **kw}, False), _loss_and_grads(model, {**batch, **kw}, True))


@pytest.mark.parametrize("kind", ["llama_lora_head", "gemma2_softcap"])
def test_bf16_autocast_matches_the_models_forward_to_bf16_precision(kind):
    """The backward recomputes the head under the forward's autocast (a bf16 head, float32 loss)."""
    model, batch = _model(kind), _batch("packed")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, ours = _loss_and_grads(model, batch, False), _loss_and_grads(model, batch, True)
    torch.testing.assert_close(ours[0], full[0], rtol=2e-3, atol=0)
    for ga, gb in zip(full[1], ours[1], strict=True):
        scale = ga.abs().max().item()
        assert (gb - ga).abs().max().item() <= 2e-2 * scale + 1e-6


def test_z_loss_and_row_statistics_come_from_the_chunks():
    model, batch = _model("llama_lora"), _batch("padded")
    base = model.get_base_model()
    hidden = base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    logits = base.lm_head(hidden).float()
    target = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].reshape(-1)
    keep = target.ne(-100)
    flat = logits.reshape(-1, V)[keep]
    lse = torch.logsumexp(flat, -1)
    expected = torch.nn.functional.cross_entropy(flat, target[keep]) + 1e-2 * lse.pow(2).mean()

    calls = []

    def fn(logits, gold):
        calls.append(len(gold))
        return (logits.amax(-1),)

    (g_full,) = torch.autograd.grad(expected, hidden, retain_graph=True)
    for checkpointed in (False, True):  # the autograd function, and plain autograd under checkpoint (ZeRO-3/FSDP2)
        calls.clear()
        out = chunked_cross_entropy(
            hidden, base.lm_head, batch["labels"], chunk_size=4, z_loss=1e-2, row_fns=[fn], checkpointed=checkpointed
        )
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=0)
        torch.testing.assert_close(out.rows, torch.nonzero(keep).reshape(-1))
        torch.testing.assert_close(out.row_stats[fn][0], flat.amax(-1).detach())
        (g_chunked,) = torch.autograd.grad(out.loss, hidden, retain_graph=True)
        torch.testing.assert_close(g_chunked, g_full, rtol=1e-5, atol=1e-6 * g_full.abs().max().item())
        assert sum(calls) == int(keep.sum()) and len(calls) == -(-int(keep.sum()) // 4)  # once per chunk, forward only


def test_a_batch_without_a_supervised_token_gives_a_zero_gradient_under_num_items():
    model, batch = _model("llama_lora"), _batch("padded")
    batch["labels"] = torch.full_like(batch["labels"], -100)
    loss, grads = _loss_and_grads(model, {**batch, "num_items_in_batch": torch.tensor(8)}, True)
    assert loss.item() == 0.0 and all(not g.any() for g in grads)


def test_extra_empty_chunks_call_the_head_forward_and_backward_and_change_nothing():
    """Where the head is gathered per call (ZeRO-3, FSDP2) the ranks run the same chunk count: the extra chunks are
    empty, and each still calls the head in the forward and in the backward (the collectives must pair up)."""
    model, batch = _model("llama_lora_head"), _batch("padded")
    base = model.get_base_model()
    calls = []
    base.lm_head.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for agree in (None, lambda n: n + 3):
        calls.clear()
        hidden = base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        out = chunked_cross_entropy(hidden, base.lm_head, batch["labels"], chunk_size=8, agree_chunks=agree)
        results.append((out.loss.detach(), torch.autograd.grad(out.loss, params)))
        n = len(out.rows)
        forward = [8] * (n // 8) + [n % 8] * (n % 8 > 0) + ([0] * 3 if agree else [])
        assert calls == forward + forward[::-1]  # the backward recomputes them in reverse order
    loss_a, grads_a = results[0]
    loss_b, grads_b = results[1]
    assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


@pytest.mark.parametrize("kind", ["llama_lora_head", "llama_saved_head", "gemma2_softcap"])
def test_a_trainable_head_under_zero3_or_fsdp2_takes_checkpointed_chunks_with_the_same_loss_and_gradients(kind):
    """ZeRO-3 / FSDP2 (`StepEngine.params_outside_forward` false): a trainable head's parameters cannot be autograd
    inputs of the chunks, so each chunk runs by plain autograd under `torch.utils.checkpoint`: still chunk rows
    only (never ``[B, T, H]`` into the head), the head called again in the backward, the same loss and gradients.
    A frozen head keeps the autograd function. The engine is stood in for (its flag is what the decision reads);
    tests/test_chunked_loss_engines.py runs the real engines."""
    from hf_stable.core import engine

    class Sharded(engine.StepEngine):
        params_outside_forward = False

    model, batch = _model(kind), _batch("padded")
    full = _loss_and_grads(model, batch, False)
    engine._ENGINES[model] = Sharded()
    head = model.get_base_model().get_output_embeddings()
    inputs = []
    hook = head.register_forward_hook(lambda m, a, o: inputs.append(a[0].dim()))
    with chunked_training_forward(model, TrainingLossConfig(chunk_size=5)) as run:
        assert run.checkpointed == any(p.requires_grad for p in head.parameters())
    ours = _loss_and_grads(model, batch, True)
    hook.remove()
    n_chunks = -(-int(batch["labels"][:, 1:].ne(-100).sum()) // 5)
    assert inputs == [2] * (2 * n_chunks)  # chunk rows, in the forward and again in the backward
    _assert_same(full, ours)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    head_grads = [g for n, g in zip(names, ours[1], strict=True) if "lm_head" in n]
    assert len(head_grads) == {"llama_lora_head": 2, "llama_saved_head": 1, "gemma2_softcap": 0}[kind]
    assert all(g.abs().sum() > 0 for g in head_grads)  # the trainable head trained through the chunks


class _HeadInputs(TrainerCallback):
    """Records the rank of every LM head input: 2 on the chunked path ([rows, H]), 3 on the model's ([B, T, H])."""

    def __init__(self, model):
        self.ranks: list[int] = []
        model.get_base_model().lm_head.register_forward_hook(lambda m, a, o: self.ranks.append(a[0].dim()))


def _train(tmp_path, chunked: bool, listener=None, steps: int = 6):
    model = tiny_lora_llama()
    heads = _HeadInputs(model)
    if listener is not None:
        StepTap.shared(model).attach().add_output_listener(listener)
    args = training_args(tmp_path / f"c{int(chunked)}", max_steps=steps, learning_rate=5e-3, max_grad_norm=1.0)
    trainer = StableTrainer(
        model=model, args=args, train_dataset=token_data(), training_loss=TrainingLossConfig(chunked=chunked)
    )
    trainer.train()
    return trainer, heads


def test_trainer_chunked_steps_train_like_the_full_path_and_evaluation_keeps_logits(tmp_path):
    full, heads_full = _train(tmp_path, chunked=False)
    chunked, heads = _train(tmp_path, chunked=True)
    assert heads_full.ranks == [3] * 6 and heads.ranks and set(heads.ranks) == {2}  # every step, chunked
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (full, chunked)]
    assert len(losses[1]) == 6 and losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    weights = [{n: p for n, p in t.model.named_parameters() if p.requires_grad} for t in (full, chunked)]
    assert weights[0].keys() == weights[1].keys() and weights[0]
    for name, w in weights[0].items():  # 6 clipped AdamW steps later, the same adapter
        torch.testing.assert_close(weights[1][name], w, rtol=1e-4, atol=1e-6)
    heads.ranks.clear()
    metrics = chunked.evaluate(token_data(n=8))  # evaluation: the model's forward (logits for compute_metrics)
    assert set(heads.ranks) == {3} and metrics["eval_loss"] > 0
    heads.ranks.clear()
    chunked.model.train()
    batch = chunked._prepare_inputs({k: torch.stack([r[k] for r in token_data(n=2)]) for k in ("input_ids", "labels")})
    loss, out = chunked.compute_loss(chunked.model, batch, return_outputs=True)
    assert out.logits is not None and heads.ranks == [3] and torch.isfinite(loss)


def test_a_listener_that_reads_logits_keeps_the_full_path(tmp_path):
    seen = []
    _, heads = _train(tmp_path, chunked=True, listener=lambda kw, out, ids: seen.append(out.logits.shape), steps=2)
    assert heads.ranks == [3, 3] and len(seen) == 2


def test_models_whose_forward_is_not_head_plus_cross_entropy_keep_it():
    torch.manual_seed(0)
    scaled = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=V, num_key_value_heads=2, **SMALL))
    scaled.config.logit_scale = 0.5
    assert "scales its logits" in unsupported_reason(scaled)
    with chunked_training_forward(scaled, TrainingLossConfig()) as run:
        assert run is None


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_forensics_per_sample_statistics_come_out_of_the_chunks_unchanged(layout):
    from hf_stable.forensics.sample_loss import (
        answer_row_fn,
        chunk_answer_stats,
        chunk_sample_loss,
        per_sample_answer_stats,
        per_sample_loss,
    )

    model, batch = _model("llama_lora"), _batch(layout)
    g = torch.Generator().manual_seed(5)
    prefixes = torch.randint(-1, V, (V, 3), generator=g)  # -1: no prefix
    text = torch.rand(V, generator=g) > 0.2
    rows = answer_row_fn(lambda vocab, device: prefixes)
    where = (batch["labels"], batch.get("position_ids"), 3)
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
        with chunked_training_forward(model, TrainingLossConfig(chunk_size=4), row_fns=[rows]):
            chunked = model(**batch, use_cache=False).chunked
    for full, ours in [
        (per_sample_loss(logits, *where), chunk_sample_loss(chunked, *where)),
        (per_sample_answer_stats(logits, *where, prefixes, text), chunk_answer_stats(chunked, rows, *where, text)),
    ]:
        for a, b in zip(full, ours, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_screening_runs_on_the_chunks_and_sees_what_the_full_path_sees(tmp_path, monkeypatch):
    from hf_stable.callbacks import spike_forensics as sf
    from tests.dist_scripts.forensics_run import build

    seen: dict[bool, list] = {True: [], False: []}
    real = sf.SpikeForensics._sample_losses

    def record(self, kwargs, source, ids):
        out = real(self, kwargs, source, ids)
        seen[not isinstance(source, torch.Tensor)].append(out)
        return out

    monkeypatch.setattr(sf.SpikeForensics, "_sample_losses", record)
    for chunked in (True, False):
        trainer, _, _ = build(
            tmp_path / str(chunked), factor=1.0, poison_index=-1, steps=3, forensics_kw={"screen": True}
        )
        trainer.training_loss = TrainingLossConfig(chunked=chunked)
        trainer.train()
    assert len(seen[True]) == len(seen[False]) == 3  # chunked run: every step from the chunks, no full logits
    for ours, full in zip(seen[True], seen[False], strict=True):
        for a, b in zip(full, ours, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.slow
def test_the_recipe_trains_with_the_default_chunked_loss_like_the_full_path(tmp_path):
    import json

    from tests.test_recipe import run_recipe, tiny_overrides

    losses = {}
    for chunked in ("true", "false"):
        tmp = tmp_path / chunked
        tmp.mkdir()
        extra = [
            "--training_loss.chunked",
            chunked,
            "--evaluation.before",
            "false",
            "--evaluation.exact_match_samples",
        ]
        proc = run_recipe([*tiny_overrides(tmp, "llama", steps=6), *extra, "0"])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        state = json.loads((tmp / "out" / "trainer_state.json").read_text())
        losses[chunked] = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses["true"]) == 3 and losses["true"] == pytest.approx(losses["false"], rel=1e-4)
    assert losses["true"][-1] < losses["true"][0]  # it trains


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("num_items", [None, 40])
def test_the_step_tap_counts_the_same_supervised_tokens_on_the_chunked_path(layout, num_items):
    """The guards' step loss (`StepTap`: token-weighted sum / token count) is the same on both paths; on the chunked
    one the count is the number of rows the loss listed, a host number (no tensor made for it)."""
    model = _model("llama_lora")
    batch = _batch(layout)
    if num_items is not None:
        batch["num_items_in_batch"] = torch.tensor(num_items)
    tap = StepTap.shared(model).attach()
    seen = {}
    for chunked in (False, True):
        tap.begin_step()
        with chunked_training_forward(model, TrainingLossConfig(chunked=chunked, chunk_size=5)) as run:
            model(**batch, use_cache=False)
        assert (run is not None and run.calls == 1) == chunked
        scalars = tap.device_scalars()
        seen[chunked] = (float(scalars["loss_num"]), scalars["loss_den"])
    tokens = int(batch["labels"][:, 1:].ne(-100).sum())
    assert isinstance(seen[True][1], float) and seen[True][1] == tokens
    assert isinstance(seen[False][1], torch.Tensor) and float(seen[False][1]) == tokens
    assert seen[True][0] == pytest.approx(seen[False][0], rel=1e-5) and seen[True][0] > 0
