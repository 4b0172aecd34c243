"""Dry run: a few real optimizer steps on real batches, then every trained weight put back.

What it answers that no config check can: does every parameter meant to train get a finite, non-zero gradient
(a frozen LoRA B, a detached module or a missed target shows up here), is the loss finite and non-trivial, how
noisy are the per-group gradient norms, how does memory scale with the micro-batch and how much of a step is
spent waiting for data.

Phase 1 takes `dry_run_steps` optimizer steps in the Trainer's order (forward, backward, clip at
`max_grad_norm` or hf_stable's clipping cap, optimizer, scheduler, zero grad) with the run's own optimizer
factory and LR schedule. Phase 2 reads the gradients of as many further batches at the weights phase 1 reached,
without stepping: the per-group mean / std rule is judged there, because over the first optimizer steps of a
LoRA run the norms mostly trace the start-up (B grows from zero while warmup starts at LR 0). Measured on the
default recipe: std/mean 0.4-0.7 in every LoRA group over steps 2-10, 0.1-0.2 across batches at fixed weights.
Afterwards the trainable weights, gradients, train/eval mode, checkpointing state and RNG states are restored
and the optimizer is dropped: the model leaves exactly as it came, except that it may now live on the training
device (where the Trainer would move it anyway).
"""

from __future__ import annotations

import gc
import itertools
import math
import time
import warnings

import torch

from hf_stable.config.doctor import DoctorConfig
from hf_stable.distributed import launch_world_size
from hf_stable.doctor.findings import Finding
from hf_stable.doctor.gradients import GradientReader, check_trainable, gradient_findings, group_statistics
from hf_stable.doctor.memory import probe_memory
from hf_stable.doctor.restore_point import RestorePoint, is_checkpointing
from hf_stable.doctor.settings import TrainingSettings
from hf_stable.optim.roles import group_parameters
from hf_stable.precision import training_autocast


def _f(severity: str, name: str, what: str, evidence: str = "", fix: str = "") -> Finding:
    return Finding(severity, what, evidence, fix, check=f"dry_run.{name}")


def _total_steps(s: TrainingSettings, n_train: int) -> int:
    if int(s.get("max_steps", -1)) > 0:
        return int(s.get("max_steps"))
    batches = math.ceil(n_train / max(s.micro_batch * launch_world_size(), 1))  # the Trainer's len(dataloader)/rank
    per_epoch = max(math.ceil(batches / s.accumulation), 1)
    return max(math.ceil(per_epoch * float(s.get("num_train_epochs", 1.0))), 1)


def _build_optimizer(model, cfg, s: TrainingSettings, total: int):
    from transformers import get_scheduler

    from hf_stable.optim import build_optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eps-guard warning is a hazard finding already
        opt = build_optimizer(
            model,
            cfg.optim,
            None,
            lr=s.learning_rate,
            weight_decay=float(s.get("weight_decay", 0.0)),
            betas=(float(s.get("adam_beta1", 0.9)), float(s.get("adam_beta2", 0.999))),
            eps=float(s.get("adam_epsilon", 1e-8)),
            fp16=s.fp16 or cfg.model.dtype == "float16",
        )
    warm = s.get("warmup_steps", 0) or 0
    warm = int(warm) if warm >= 1 else math.ceil(total * float(warm or s.get("warmup_ratio", 0.0) or 0.0))
    sched = get_scheduler(
        s.get("lr_scheduler_type", "linear"),
        opt,
        num_warmup_steps=warm,
        num_training_steps=total,
        scheduler_specific_kwargs=s.get("lr_scheduler_kwargs") or {},
    )
    return opt, sched


def _target_device(model, s: TrainingSettings) -> torch.device:
    if torch.cuda.is_available():
        dev = getattr(s.args, "device", None)
        return torch.device(dev) if dev is not None else torch.device("cuda", 0)
    return next(model.parameters()).device


def _autocast_factory(device: torch.device, s: TrainingSettings):
    """The Trainer's own autocast (`precision.training_autocast`): bf16 on CPU too, so the doctor measures the
    numeric path the run will take."""
    return lambda: training_autocast(s, device)


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def dry_run(model, data, cfg, s: TrainingSettings, doctor: DoctorConfig) -> tuple[dict, list[Finding]]:
    """Run `doctor.dry_run_steps` optimizer steps on `data.train_dataset` and restore the model.

    Args:
        model: the model to train (PEFT-wrapped or plain), as the Trainer will get it.
        data: a `DataBundle` (or anything with `train_dataset` and `collator`).
        cfg: the `RunConfig` (optimizer section, lora, dtype).
        s: the resolved training values; doctor: thresholds.

    Returns:
        (facts, findings): facts hold the per-step losses, per-group grad-norm statistics, memory and timings.
    """
    findings = check_trainable(model, cfg.lora.enabled)
    if any(f.check == "dry_run.trainable" for f in findings):
        return {}, findings
    snap = RestorePoint(model)
    try:
        return _run(model, data, cfg, s, doctor, findings)
    finally:
        snap.restore()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _run(model, data, cfg, s, doctor, findings) -> tuple[dict, list[Finding]]:
    from torch.utils.data import DataLoader

    from hf_stable.modeling import is_quantized

    device = _target_device(model, s)
    if is_quantized(model):  # bitsandbytes placed it while loading (8-bit models refuse .to)
        device = next(model.parameters()).device
    else:
        model.to(device)
    model.train()
    if s.gradient_checkpointing and not is_checkpointing(model):  # as the Trainer will do
        kwargs = s.checkpointing_kwargs or {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    autocast = _autocast_factory(device, s)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and s.fp16 else None
    n_train, b, accum = len(data.train_dataset), s.micro_batch, s.accumulation
    opt, sched = _build_optimizer(model, cfg, s, _total_steps(s, n_train))
    seed = int(s.get("seed", 42))
    loader = DataLoader(
        data.train_dataset,
        batch_size=b,
        shuffle=True,
        collate_fn=data.collator,
        drop_last=n_train >= b,
        num_workers=int(s.get("dataloader_num_workers", 0)),
        generator=torch.Generator().manual_seed(seed),
    )
    batches = itertools.chain.from_iterable(itertools.repeat(loader))

    groups = group_parameters(model, trainable_only=True)
    gnames = list(groups)
    entries = [(n, p, gi) for gi, g in enumerate(gnames) for n, p in groups[g]]
    grads = GradientReader(model, [n for n, _, _ in entries], device)
    max_norm = _clip_norm(cfg, s)
    rows, t_data, t_compute, tokens = [], [], [], []

    def micro_batches(unscale: bool = True):
        """Forward/backward over one optimizer step's micro-batches; returns (loss, data wait, compute, tokens)."""
        wait = compute = 0.0
        n_tok, loss_sum = 0, torch.zeros((), device=device)
        for _ in range(accum):
            t0 = time.perf_counter()
            batch = _to(next(batches), device)
            t1 = time.perf_counter()
            with autocast():
                loss = model(**batch, use_cache=False).loss / accum
            (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += loss.detach().float()
            n_tok += int(batch["input_ids"].numel())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wait, compute = wait + (t1 - t0), compute + (time.perf_counter() - t1)
        if scaler and unscale:
            scaler.unscale_(opt)  # noqa: F821 - `opt` of _run, deleted only after the last call
        return loss_sum, wait, compute, n_tok

    # Phase 1: real optimizer steps (Trainer order). Do gradients reach every parameter? Is the loss sane?
    for step in range(1, doctor.dry_run_steps + 1):
        loss_sum, wait, compute, n_tok = micro_batches()
        t1 = time.perf_counter()
        rows.append({"step": step, **grads.read(loss_sum)})
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p, _ in entries], max_norm)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_data.append(wait)
        t_compute.append(compute + time.perf_counter() - t1)
        tokens.append(n_tok)
        if not math.isfinite(rows[-1]["loss"]):
            break

    # Phase 2: the same number of batches at the weights phase 1 reached, no step. The spread of the per-group
    # norms across batches is the gradient noise the mean/std rule is about; over phase 1 the norms mostly show
    # the start-up trend (LoRA B grows from zero, warmup starts at LR 0).
    noise = []
    if all(math.isfinite(r["loss"]) for r in rows):
        for _ in range(doctor.dry_run_steps):
            loss_sum, *_ = micro_batches(unscale=False)  # no step follows, so GradScaler is not involved
            scale = scaler.get_scale() if scaler else 1.0
            noise.append({"step": len(noise) + 1, **grads.read(loss_sum, track=False, scale=scale)})
            opt.zero_grad(set_to_none=True)

    facts: dict = {"device": str(device), "steps": len(rows), "micro_batch": b, "accumulation": accum}
    facts["losses"] = [r["loss"] for r in rows]
    findings += _loss_findings(rows)
    names = [n for n, _, _ in entries]
    ever_ok, ever_bad = grads.verdicts()
    findings += gradient_findings(names, ever_ok, ever_bad, scaler is not None, rows)
    facts["grad_norms_per_step"] = [{"step": r["step"], **dict(zip(gnames, r["norms"], strict=False))} for r in rows]
    stats, grad_findings = group_statistics(noise, gnames, doctor)
    facts["grad_norms"] = stats
    findings += grad_findings
    facts["timing"], timing_findings = _timing(t_data, t_compute, tokens, cfg)
    findings += timing_findings
    if doctor.memory_probe and all(math.isfinite(r["loss"]) for r in rows):
        facts["memory"], mem_findings = _memory(model, data, b, device, autocast, doctor)
        findings += mem_findings
    del opt, sched
    return facts, findings


def _clip_norm(cfg, s: TrainingSettings) -> float:
    """The global clip the run will apply: the Trainer's max_grad_norm, else hf_stable's clipping cap."""
    norm = float(s.get("max_grad_norm", 0.0) or 0.0)
    if norm > 0:
        return norm
    clip = getattr(getattr(getattr(cfg, "stability", None), "guards", None), "clipping", None)
    cap = getattr(clip, "max_norm", None) if getattr(clip, "enabled", False) else None
    return float(cap) if cap else 0.0


def _loss_findings(rows: list[dict]) -> list[Finding]:
    losses = [r["loss"] for r in rows]
    bad = [r["step"] for r in rows if not math.isfinite(r["loss"])]
    if bad:
        return [
            _f(
                "error",
                "loss",
                f"the loss is not finite at dry-run step {bad[0]}",
                f"losses: {', '.join(f'{x:.4g}' for x in losses)}",
                "look for fp16 overflow, a too-high LR, or bad samples; hf-stable audit checks the data",
            )
        ]
    if losses and losses[0] < 1e-4:
        return [
            _f(
                "error",
                "loss",
                "the loss is ~0 before any training",
                f"first loss {losses[0]:.3g}",
                "the labels probably leak the answer (no shift, or labels == inputs everywhere) or the task is "
                "trivial; check the data and the collator",
            )
        ]
    trend = f"{losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps"
    return [_f("ok", "loss", "loss is finite and non-trivial", trend)]


def _timing(t_data, t_compute, tokens, cfg) -> tuple[dict, list[Finding]]:
    skip = 1 if len(t_data) > 2 else 0  # the first step pays for lazy init and allocator warm-up
    data, comp, tok = sum(t_data[skip:]), sum(t_compute[skip:]), sum(tokens[skip:])
    n = max(len(t_data) - skip, 1)
    facts = {
        "step_seconds": (data + comp) / n,
        "data_seconds": data / n,
        "compute_seconds": comp / n,
        "data_share": data / max(data + comp, 1e-12),
        "tokens_per_second": tok / max(data + comp, 1e-12),
    }
    ratio = data / max(comp, 1e-12)
    facts["data_compute_ratio"] = ratio
    thr = getattr(getattr(cfg.stability, "monitors", None), "throughput", None)
    mild, severe = getattr(thr, "mild_ratio", 1.2), getattr(thr, "severe_ratio", 2.5)
    evidence = (
        f"step {facts['step_seconds'] * 1e3:.0f} ms, data {facts['data_share']:.0%} of it "
        f"(wait/compute {ratio:.2f}), {facts['tokens_per_second']:.0f} tokens/s"
    )
    if ratio > severe:
        return facts, [
            _f(
                "warning",
                "throughput",
                "the dataloader dominates the step (severe stall)",
                evidence,
                "raise training.dataloader_num_workers or pre-tokenize the data",
            )
        ]
    if ratio > mild:
        return facts, [
            _f(
                "info",
                "throughput",
                "the dataloader takes longer than the compute (mild stall)",
                evidence,
                "raise training.dataloader_num_workers",
            )
        ]
    return facts, [_f("ok", "throughput", "step time", evidence)]


def _memory(model, data, b: int, device, autocast, doctor: DoctorConfig) -> tuple[dict, list[Finding]]:
    n = len(data.train_dataset)

    def make_batch(k: int) -> dict:
        rows = [data.train_dataset[i % n] for i in range(k)]
        return _to(data.collator(rows), device)

    p = probe_memory(
        model,
        make_batch,
        b,
        device,
        autocast,
        tolerance=doctor.memory_linear_tolerance,
        headroom=doctor.memory_headroom,
    )
    facts = dict(vars(p))
    if p.device == "cpu":
        ev = (
            f"RSS {p.base_mib:.0f} MiB before; high-water mark {p.peak_b_mib:.0f} MiB at b={b}, "
            f"{p.peak_2b_mib:.0f} MiB at 2b={2 * b}; RSS growth {p.rss_growth_mib:+.0f} MiB"
        )
        return facts, [_f("info", "memory", f"CPU memory at micro-batch {b} and {2 * b}", ev)]
    if p.oom_at == b:
        return facts, [
            _f(
                "error",
                "memory",
                f"micro-batch {b} does not fit in GPU memory",
                f"{p.base_mib:.0f} MiB allocated before the pass",
                "lower per_device_train_batch_size and "
                "raise gradient_accumulation_steps, or enable gradient checkpointing",
            )
        ]
    ev = f"peak {p.peak_b_mib:.0f} MiB at b={b}"
    if p.oom_at:
        return facts, [_f("info", "memory", f"2b={2 * b} does not fit: the largest micro-batch is below it", ev)]
    ev += (
        f", {p.peak_2b_mib:.0f} MiB at 2b (activations x{p.ratio:.2f}); estimated largest micro-batch "
        f"{p.max_micro_batch} within {doctor.memory_headroom:.0%} of {p.total_mib:.0f} MiB"
    )
    if not p.linear:
        return facts, [
            _f(
                "warning",
                "memory",
                "activation memory is not linear in the micro-batch",
                ev,
                "padding to the longest sample or attention without a fused kernel grows faster than "
                "linear; use packing (data.packing: true) or flash attention",
            )
        ]
    if p.max_micro_batch is not None and p.max_micro_batch < b:
        return facts, [
            _f(
                "warning",
                "memory",
                "little GPU memory headroom at the configured micro-batch",
                ev,
                "lower per_device_train_batch_size",
            )
        ]
    return facts, [_f("ok", "memory", "memory is linear in the micro-batch", ev)]
