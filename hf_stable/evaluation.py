"""Greedy exact-match evaluation on held-out prompts (the recipe's before/after check).

The prompts are the training prompts (``hf_stable.data.encode_prompt``: the chat template's generation prompt, the
empty think block of a thinking template included) and generation stops where training taught an answer to end: at
the template's end-of-turn token (``DataBundle.stop_token_ids``), not only at ``tokenizer.eos_token``.

Where the parameters are sharded across ranks (DeepSpeed ZeRO-3, FSDP2), a forward gathers each layer's shards
from every rank, so generation runs on every rank in step (`synced_gpus`) and the main process scores it; elsewhere
the main process generates alone. Either way every rank ends with the main process's result.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence


def _normalise(text: str) -> str:
    return " ".join(text.strip().split())


def exact_match(
    model,
    tokenizer,
    records: Sequence[dict],
    encode_prompt: Callable[[dict], list[int]],
    reference: Callable[[dict], str],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 64,
    stop_token_ids: Sequence[int] | None = None,
    synced: bool = False,
) -> dict:
    """Generate greedily for each record and compare the answer (up to the first stop token) with the reference.

    Prompts are left-padded for generation only; training batches stay right-padded. `stop_token_ids` default to
    the tokenizer's EOS; pass ``DataBundle.stop_token_ids`` to stop at the template's end of turn. `synced=True`
    (every rank calls this with the same records) keeps the ranks' forwards in step until all are done, as sharded
    parameters need (transformers' `synced_gpus`).

    Returns:
        {"exact_match": fraction, "n": count, "by_family": {family: fraction}, "examples": first 5 triples}
    """
    import torch

    was_training = model.training
    model.eval()
    stops = [int(t) for t in (stop_token_ids or [tokenizer.eos_token_id])]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[-1]
    device = next(model.parameters()).device
    hits: list[bool] = []
    per_family: dict[str, list[bool]] = defaultdict(list)
    examples = []
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            prompts = [encode_prompt(r) for r in chunk]
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), pad, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    eos_token_id=stops,
                    synced_gpus=synced,
                )
            for rec, row in zip(chunk, out[:, width:].tolist(), strict=False):
                row = row[: next((k for k, t in enumerate(row) if t in stops), len(row))]
                answer = tokenizer.decode(row, skip_special_tokens=True)
                ok = _normalise(answer) == _normalise(reference(rec))
                hits.append(ok)
                per_family[str(rec.get("family", "all"))].append(ok)
                if len(examples) < 5:
                    examples.append({"reference": reference(rec), "generated": answer, "match": ok})
    finally:
        model.train(was_training)
    n = len(hits)
    return {
        "exact_match": sum(hits) / n if n else float("nan"),
        "n": n,
        "by_family": {k: sum(v) / len(v) for k, v in sorted(per_family.items())},
        "examples": examples,
    }


SHORT_ENOUGH = 0.5  # share of the answers that must fit the generation budget for exact match to mean something


def exact_match_skip_reason(answer_tokens, max_new_tokens: int) -> str | None:
    """Why exact match would measure nothing on answers of these lengths (tokens of answer + end token), or None.

    The rule: exact match runs when at least half of the scored answers fit ``evaluation.max_new_tokens`` (the
    median answer fits). Greedy generation is cut at that budget, so a longer answer can never match: on free-form
    chat answers the score is 0.0 by construction, which reads as a broken model. When it runs, the answers that do
    not fit count as misses (the share that cannot match is in the evaluation's log line when there are any).
    """
    lengths = list(answer_tokens)
    if not lengths:
        return None
    fit = sum(1 for n in lengths if n <= max_new_tokens)
    if fit >= SHORT_ENOUGH * len(lengths):
        return None
    median = sorted(lengths)[len(lengths) // 2]
    return (
        f"exact match skipped: {len(lengths) - fit} of {len(lengths)} eval answers are longer than "
        f"evaluation.max_new_tokens {max_new_tokens} tokens (median {median}), so greedy generation cannot "
        "reproduce them; it runs when at least half fit (raise evaluation.max_new_tokens to score them)"
    )


def sharded_parameters(model) -> str | None:
    """Which engine shards `model`'s parameters across ranks ("ZeRO-3" / "FSDP"), or None.

    Read from the parameters themselves (ZeRO-3 marks them with `ds_id`, FSDP2 makes them DTensors), so it is true
    only once the engine has sharded them: under FSDP2 the model is whole until the Trainer prepares it.
    """
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if hasattr(p, "ds_id"):
            return "ZeRO-3"
        if isinstance(p, DTensor):
            return "FSDP"
    return None


def _zero3_without_engine(trainer, sharded: str | None) -> bool:
    """ZeRO-3 parameters that no DeepSpeed engine gathers yet (before `trainer.train()`): a forward cannot run."""
    return sharded == "ZeRO-3" and getattr(trainer, "deepspeed", None) is None


def evaluate_run(trainer, tokenizer, data, eval_cfg, *, prefix: str) -> dict:
    """Eval loss over the eval set plus exact match on up to `eval_cfg.exact_match_samples` held-out prompts.

    Under DeepSpeed call it once the engine exists (inside or after `trainer.train()`; the recipe's evaluation
    before training is `BeforeTrainingEvaluation`): an evaluation before it makes transformers build an inference
    engine, which ZeRO-1/2 refuse and which leaves ZeRO-3 without a training engine. Every rank gets the same result.
    """
    from hf_stable.data import encode_prompt, reference_answer
    from hf_stable.distributed import broadcast_object
    from hf_stable.logging import get_logger, is_main_process

    out: dict = {}
    if data.eval_dataset is not None:
        metrics = trainer.evaluate(metric_key_prefix=f"eval_{prefix}")
        out["eval_loss"] = metrics.get(f"eval_{prefix}_loss")
    n = min(eval_cfg.exact_match_samples, len(data.eval_records))
    skip = exact_match_skip_reason((getattr(data, "eval_answer_tokens", None) or [])[:n], eval_cfg.max_new_tokens)
    if n and skip is not None:  # the same on every rank (config and eval data)
        n = 0
    sharded = sharded_parameters(trainer.model)
    if n and _zero3_without_engine(trainer, sharded):
        get_logger(__name__).warning(
            "%s: exact match skipped: ZeRO-3 partitions the parameters and no DeepSpeed engine gathers them before "
            "trainer.train() starts (the recipe evaluates inside training)",
            prefix,
        )
        n = 0
    if n and (sharded is not None or is_main_process()):
        template = getattr(data, "template", "auto")
        em = exact_match(
            trainer.model,
            tokenizer,
            data.eval_records[:n],
            lambda r: encode_prompt(tokenizer, r, template),
            reference_answer,
            max_new_tokens=eval_cfg.max_new_tokens,
            batch_size=eval_cfg.generation_batch_size,
            stop_token_ids=getattr(data, "stop_token_ids", None),
            synced=sharded is not None,
        )
        out["exact_match"] = em["exact_match"]
        out["exact_match_detail"] = em
    if n:  # n is the same on every rank (config and eval data), so every rank enters the broadcast
        shared = broadcast_object({k: out.get(k) for k in ("exact_match", "exact_match_detail")})
        out.update(shared)
    if is_main_process():
        if "exact_match" in out:
            by_family = (out.get("exact_match_detail") or {}).get("by_family")
            em_text = f"exact match {out['exact_match']} on {n} prompts" + (f" {by_family}" if by_family else "")
        else:  # exact_match_samples 0, no held-out records, answers too long, or ZeRO-3
            em_text = skip or "exact match: off"
        loss = f"eval loss {out['eval_loss']}" if out.get("eval_loss") is not None else "eval loss: no eval set"
        get_logger(__name__).info("%s: %s, %s", prefix, loss, em_text)
    return out


def results_line(summary: dict) -> str:
    """The recipe's closing numbers, e.g. "eval loss 7.12 -> 1.33, exact match 0.0 -> 0.35"; what was not measured
    says so ("exact match: off", "eval loss 4.92 after training (not measured before)")."""

    def pair(name: str, before, after) -> str:
        before, after = (round(v, 4) if isinstance(v, float) else v for v in (before, after))
        if before is None and after is None:
            return f"{name}: off"
        if before is None:
            return f"{name} {after} after training (not measured before)"
        return f"{name} {before} -> {after}"

    return ", ".join(
        (
            pair("eval loss", summary.get("eval_loss_before"), summary.get("eval_loss_after")),
            pair("exact match", summary.get("exact_match_before"), summary.get("exact_match_after")),
        )
    )
