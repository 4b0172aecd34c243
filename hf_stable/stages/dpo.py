"""`stage: dpo`: TRL's `DPOTrainer` under `hf_stable.stabilize`, continuing the SFT run's LoRA adapter.

The reference is the SFT model: when `model.start_from` is an adapter, TRL copies it into a second adapter named
``"ref"`` and computes the reference log-probs with it. That copy is checked here against the adapter file it came
from, before training (a reference that is not the start would make every DPO reward measure the wrong thing) and
after (it must not have trained). From a merged export (or from a base), the new adapter starts at zero and the
reference is the model with the adapter disabled, which is the same function.

The pairs are tokenized by hf_stable under the SFT rules (``data/pairs_bundle.py``); `PairsDPOTrainer` only skips
TRL's own tokenization of them. The run summary holds the preference metrics of the held-out pairs before and after:
``preference_accuracy`` (pairs where the model gives the chosen answer the higher log-probability: meaningful
before training too, where TRL's reward accuracy is 0 by construction), TRL's own ``eval_rewards/*`` and the mean
log-probability of the chosen answers (a fall is likelihood displacement: docs/post-training.md).
"""

from __future__ import annotations

import math
from pathlib import Path

from hf_stable.errors import ModelError
from hf_stable.logging import get_logger, is_main_process

logger = get_logger(__name__)

REF_ADAPTER = "ref"  # the name TRL gives the copy of a continued adapter
SUMMARY_METRICS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen")


def _trainer_class():
    from trl import DPOTrainer

    class PairsDPOTrainer(DPOTrainer):
        """`DPOTrainer` that trains on pairs hf_stable tokenized (``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``)
        instead of tokenizing text again (`hf_stable.compat.TRL_DPO_METHODS` pins the signature)."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "chosen_ids" in getattr(dataset, "column_names", ()):
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    return PairsDPOTrainer


def adapter_file_tensors(directory) -> dict:
    """The tensors of a saved LoRA adapter (``adapter_model.safetensors``), by name."""
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "adapter_model.safetensors"))


def reference_difference(model, saved: dict) -> tuple[int, float]:
    """(tensors compared, largest absolute difference) between the ``"ref"`` adapter of `model` and the adapter file
    tensors `saved` it should copy (names as peft saves them: without the adapter name).

    Raises:
        ModelError: the model has no ``"ref"`` adapter, or a saved tensor has no counterpart.
    """
    ref = {n.replace(f".{REF_ADAPTER}.", "."): p for n, p in model.named_parameters() if f".{REF_ADAPTER}." in n}
    if not ref:
        raise ModelError("stage dpo: the model has no 'ref' adapter: the reference would be the base, not the SFT run")
    worst, n = 0.0, 0
    for name, tensor in saved.items():
        mine = ref.get(name)
        if mine is None:
            raise ModelError(f"stage dpo: the reference adapter has no tensor for {name} of the SFT adapter")
        worst = max(worst, float((mine.detach().float().cpu() - tensor.float()).abs().max()))
        n += 1
    return n, worst


def preference_accuracy(model, dataset, pad_id: int, batch_size: int = 32) -> dict:
    """On `dataset` (``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``): the share of pairs whose chosen answer has
    the higher summed log-probability under `model` as it is (adapter on), and the mean log-probability per chosen
    and per rejected answer token."""
    import torch

    def logps(rows, side):
        seqs = [r["prompt_ids"] + r[side] for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id)
        mask = torch.zeros_like(ids)
        answer = torch.zeros_like(ids, dtype=torch.bool)
        for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
            answer[i, len(r["prompt_ids"]) : len(s)] = True
        device = next(model.parameters()).device
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None].to(device))[..., 0].cpu()
        lp = lp * answer[:, 1:]
        return lp.sum(1), answer[:, 1:].sum(1)

    was_training = model.training
    model.eval()
    wins = n = 0
    tot = {"chosen": [0.0, 0], "rejected": [0.0, 0]}
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
            side_lp = {}
            for side in ("chosen", "rejected"):
                s, k = logps(rows, f"{side}_ids")
                side_lp[side] = s
                tot[side][0] += float(s.sum())
                tot[side][1] += int(k.sum())
            wins += int((side_lp["chosen"] > side_lp["rejected"]).sum())
            n += len(rows)
    model.train(was_training)
    return {
        "preference_accuracy": wins / n if n else math.nan,
        "chosen_logp_per_token": tot["chosen"][0] / max(1, tot["chosen"][1]),
        "rejected_logp_per_token": tot["rejected"][0] / max(1, tot["rejected"][1]),
    }


def _eval_metrics(trainer, dataset, pad_id: int, batch_size: int) -> dict:
    out = preference_accuracy(trainer.model, dataset, pad_id, batch_size)
    metrics = trainer.evaluate()
    out.update({k: metrics[f"eval_{k}"] for k in SUMMARY_METRICS if f"eval_{k}" in metrics})
    if "eval_loss" in metrics:
        out["dpo_loss"] = metrics["eval_loss"]
    return out


def run(cfg, started: float) -> dict:
    """Train the DPO stage `cfg` describes and write its outputs; returns the run summary.

    Raises:
        ModelError: the reference adapter is not a copy of the SFT adapter, or it moved during training.
        DataError: bad pair lines (file:line) unless ``data.on_bad_record: skip``; no pair left.
    """
    import time

    from hf_stable.data.pairs_bundle import build_pairs
    from hf_stable.integrations.stabilize import stabilize
    from hf_stable.stages.common import begin_stage, chain_text, save_stage_outputs
    from hf_stable.stages.start import load_stage_model

    setup = begin_stage(cfg)
    model, tokenizer, base = load_stage_model(cfg, setup.args, setup.start)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    pairs = build_pairs(
        cfg.data, tokenizer, seed=setup.args.seed, vocab_size=model.get_input_embeddings().weight.shape[0]
    )
    trainer = _trainer_class()(
        model=model,
        ref_model=None,
        args=setup.args,
        train_dataset=pairs.train_dataset,
        eval_dataset=pairs.eval_dataset,
        processing_class=tokenizer,
    )
    reference = {"kind": "base (adapter disabled)", "source": base}
    saved = None
    if setup.start is not None and setup.start.kind == "adapter":
        saved = adapter_file_tensors(setup.start.path)
        n, worst = reference_difference(trainer.model, saved)
        if worst != 0.0:
            raise ModelError(
                f"stage dpo: TRL's 'ref' adapter differs from the SFT adapter in {setup.start.path} by up to {worst:g} "
                f"over {n} tensors: the reference would not be the model DPO starts from"
            )
        reference = {
            "kind": "adapter copy ('ref')",
            "source": str(setup.start.path),
            "tensors": n,
            "max_abs_diff": 0.0,
        }
    trainer = stabilize(trainer, cfg, records=pairs.train_where or None)  # a skipped step names its pairs' lines
    pad_id = tokenizer.pad_token_id
    batch = setup.args.per_device_eval_batch_size
    before = _eval_metrics(trainer, pairs.eval_dataset, pad_id, batch) if pairs.eval_dataset is not None else {}
    t0 = time.time()
    result = trainer.train()
    train_seconds = time.time() - t0
    after = _eval_metrics(trainer, pairs.eval_dataset, pad_id, batch) if pairs.eval_dataset is not None else {}
    if saved is not None:
        _, moved = reference_difference(trainer.model, saved)
        reference["max_abs_diff_after_training"] = moved
        if moved != 0.0:
            raise ModelError(f"stage dpo: the reference adapter moved during training (up to {moved:g})")
        trainer.model.delete_adapter(REF_ADAPTER)  # a copy of the SFT adapter: not saved again with the DPO one
    summary = {
        "base_model": base,
        "started_from": str(setup.start.path) if setup.start is not None else None,
        "reference": reference,
        "train_loss": result.training_loss,
        "train_steps": trainer.state.global_step,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - started, 1),
        "data": {"eval_source": pairs.eval_source, **pairs.stats},
        "preference": {"before": before, "after": after},
    }
    summary = save_stage_outputs(cfg, setup, trainer, tokenizer, summary)
    if is_main_process():
        from hf_stable.data.prompts import stop_token_ids
        from hf_stable.reporting.generation_config import save_generation_config

        # generation stops where the pairs' answers end (the template's end of turn), as after SFT
        save_generation_config(
            setup.args.output_dir, trainer.model, tokenizer, stop_token_ids(tokenizer, pairs.template)
        )
        acc = (before.get("preference_accuracy"), after.get("preference_accuracy"))
        logger.info(
            "%s: %d steps; held-out preference accuracy %s -> %s; outputs in %s",
            chain_text(setup.chain),
            trainer.state.global_step,
            *(f"{a:.3f}" if a is not None else "n/a" for a in acc),
            setup.args.output_dir,
        )
    return summary
