"""One rescue-benchmark run: a case x an arm x a seed, in the same harness for every arm.

Harness: the case's base, LoRA r=8 on every linear layer (seeded), the Trainer's AdamW (weight decay 0), cosine
schedule with the case's warmup, batch 8 (4 per rank under DDP), `max_steps`, eval on held-out language-B rows.
An arm only adds its stability mechanism (callbacks, its own clip, or its optimizer):

* `plain`      - `Trainer`, `max_grad_norm=1.0` (the default clip).
* `hf_stable`  - what the recipe runs: `StableTrainer`, `build_callbacks(RunConfig)` (default monitors, guards
  and the attention-logit monitor, with the model on the `hf_stable` attention implementation) and
  `guard_training_overrides` (`max_grad_norm=0`: hf_stable clips).
* `hf_snr` / `hf_qkclip` / `hf_phases` - the same plus one opt-in guard, set in the recipe's YAML mapping
  (`config_from_dict`), on the cases that are theirs.
* `hf_logit_lr` - a benchmark-only variant for the attention-logit decision: `hf_stable` whose `LRControl` also
  backs off (x0.5, the rollback's backoff, factor `attn_logit`) at each sampled step where a layer's max logit
  crosses the level (`attn_logit_high`). Not a library option: the default warns and does not act (docs/monitors.md).
* the peers of `peers.py`: `olmo_skip`, `titan_megatron`, `zclip`, `spam`, `axolotl_watchdog`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import math
import tempfile
import time

import peers
import torch
from rescue_cases import BATCH, CLEAN_LR, Case, Faults, emulate_fp16, eval_rows, markov_ids, train_rows, training_args
from transformers import Trainer, TrainerCallback

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEERS = ("plain", "olmo_skip", "titan_megatron", "zclip", "spam", "axolotl_watchdog")
HF_ARMS = ("hf_stable", "hf_snr", "hf_qkclip", "hf_phases", "hf_logit_lr")
ARMS = ("plain", "hf_stable", *PEERS[1:], *HF_ARMS[1:])
OPT_IN = {  # the cases each opt-in arm runs on (where its mechanism is meant to act), plus the clean reference
    "hf_snr": ("clean", "lr_10x", "lr_30x", "no_warmup"),
    "hf_qkclip": ("clean_deep", "attn_logits"),
    "hf_phases": ("clean", "lr_10x", "lr_30x"),
    "hf_logit_lr": ("clean_deep", "attn_logits"),
}
LOGIT_BACKOFF = 0.5  # hf_logit_lr: the LR factor's multiplier per step with a new attn_logit_high
QK_TAU = 20.0  # the deep base's max attention logit starts near 8; 20 = "2.5x the healthy level"
CHECKPOINT_EVERY = 25
LOGIT_EVERY = 10


def runs_on(arm: str, case: Case) -> bool:
    return arm not in OPT_IN or case.name.removeprefix("ddp_") in OPT_IN[arm]


def hf_config(arm: str, steps: int):
    """The arm's recipe config, written as a YAML user would write it."""
    from hf_stable.config.run import config_from_dict

    data: dict = {}
    if arm == "hf_snr":  # the default interval (100) is for long runs: one check every 10 % of ours
        data = {"stability": {"guards": {"snr": {"enabled": True, "interval": max(1, steps // 10)}}}}
    elif arm == "hf_qkclip":
        data = {"attention": {"qk_clip": True, "qk_clip_tau": QK_TAU}}
    elif arm == "hf_phases":  # the default phase boundaries (500 / 2000 steps) at the same fractions of our run
        data = {
            "stability": {
                "guards": {
                    "phases": {
                        "enabled": True,
                        "phases": [
                            {"name": "adamw", "until_step": steps // 5},
                            {"name": "sgd", "until_step": 4 * steps // 5, "lr_scale": 10.0},
                            {"name": "lion", "lr_scale": 0.3},
                        ],
                    }
                }
            }
        }
    return config_from_dict(data)


@torch.no_grad()
def max_logit(model) -> float:
    """Max pre-softmax attention logit (raw scaled q.k) on a fixed batch, by hf_stable's probe, for any arm."""
    from hf_stable.attention import get_probe, register
    from hf_stable.compat import attn_implementation

    register()
    inner = model.get_base_model()
    impl, training = attn_implementation(inner), model.training
    probe = get_probe()
    inner.set_attn_implementation("hf_stable")
    model.train()  # the probe samples training-mode forwards only (this one runs without grad: no fault, no tap)
    try:
        probe.arm(-1)
        model(input_ids=markov_ids(16, seed=77, remap=0.5))
        probe.disarm()
        value = max(probe.layer_maxima(reduce=True).values())
    finally:
        probe.reset()
        inner.set_attn_implementation(impl)
        model.train(training)
    return value


class LogitBackoff(TrainerCallback):
    """hf_logit_lr: multiplies `LRControl`'s `attn_logit` factor by LOGIT_BACKOFF at each step where the attention
    monitor wrote a new `attn_logit_high` (listed after the monitor, so it reads that step's events)."""

    def __init__(self, monitor, lr_control):
        self.monitor, self.lr_control, self.seen, self.backoffs = monitor, lr_control, 0, 0

    def on_step_end(self, args, state, control, **kw):
        events = self.monitor.events
        new = [e for e in events[self.seen :] if e["kind"] == "attn_logit_high"]
        self.seen = len(events)
        if new:
            self.lr_control.multiply("attn_logit", LOGIT_BACKOFF)
            self.backoffs += 1


class LogitMeter(TrainerCallback):
    def __init__(self, every: int):
        self.every, self.values = every, []

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step % self.every == 0:
            self.values.append(max_logit(model))


def _build(arm: str, model, case: Case, steps: int, training: dict):
    """(trainer class, callbacks, TrainingArguments overrides, optimizer factory of the args or None) of an arm."""
    if arm == "plain":
        return Trainer, [], {"max_grad_norm": 1.0}, None
    if arm in HF_ARMS:
        from hf_stable.callbacks import build_callbacks
        from hf_stable.callbacks.guards import guard_training_overrides
        from hf_stable.trainer import StableTrainer

        cfg = hf_config(arm, steps)
        cfg.training = training
        make = None
        if cfg.stability.guards.phases.enabled:  # as the recipe: the factory's optimizer, wrapped for the phases
            from hf_stable.config.optim import OptimConfig
            from hf_stable.optim import build_optimizer
            from hf_stable.optim.phases import wrap_for_phases

            same = OptimConfig(llrd_decay=1.0, lora_plus_ratio=1.0)  # one group at the Trainer's LR, as the others

            def make(args):
                return wrap_for_phases(build_optimizer(model, same, args), cfg.stability.guards.phases, same, args)

        callbacks = build_callbacks(cfg)
        if arm == "hf_logit_lr":
            from hf_stable.callbacks.guards.lr_control import LRControl
            from hf_stable.callbacks.monitors.attention_monitor_callback import AttentionMonitorCallback

            monitor = next(cb for cb in callbacks if isinstance(cb, AttentionMonitorCallback))
            lr_control = next(cb for cb in callbacks if isinstance(cb, LRControl))
            callbacks.append(LogitBackoff(monitor, lr_control))
        return StableTrainer, callbacks, guard_training_overrides(cfg.stability.guards, training), make
    checkpoints = peers.Checkpoints(model, CHECKPOINT_EVERY)
    if arm == "olmo_skip":
        return Trainer, [peers.OlmoSkipStep()], {"max_grad_norm": 0.0}, None
    if arm == "titan_megatron":
        return Trainer, [peers.NonFiniteStop(), checkpoints], {"max_grad_norm": 0.0}, None
    if arm == "zclip":
        return Trainer, [peers.ZClip()], {"max_grad_norm": 0.0}, None
    if arm == "spam":
        interval = max(2, steps // 2)

        def make(args):
            return peers.SpamAdamW(
                peers.trainable(model),
                lr=args.learning_rate,
                interval=interval,
                warmup=max(1, round(0.3 * interval)),
                clip_after=min(20, interval // 2),
            )

        return Trainer, [], {"max_grad_norm": 0.0}, make
    if arm == "axolotl_watchdog":
        return (
            Trainer,
            [peers.LossWatchdog(threshold=peers.WATCHDOG_THRESHOLD), checkpoints],
            {"max_grad_norm": 1.0, "logging_steps": 1},
            None,
        )
    raise ValueError(f"unknown arm {arm!r}")


def _events(callbacks) -> list[dict]:
    return [e for cb in callbacks for e in getattr(cb, "events", [])]


def event_summary(events: list[dict], history: list[dict]) -> dict:
    """What the run said: `{kind: [count, severity]}` (the highest severity of the kind) and the stability verdict
    of the benchmark tree's rule (`hf_stable.reporting.verdict`, loaded from this checkout's file, so a `--tree`
    package older than the verdict is judged by the same rule on its own events)."""
    rank = {"info": 0, "warning": 1, "error": 2}
    kinds: dict[str, list] = {}
    for e in events:
        count, severity = kinds.get(e["kind"], [0, "info"])
        sev = e.get("severity", "warning")
        kinds[e["kind"]] = [count + 1, sev if rank.get(sev, 1) > rank.get(severity, 0) else severity]
    return {"kinds": kinds, "verdict": _verdict_rule()(events, history=history)["verdict"]}


def _verdict_rule():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "hf_stable" / "reporting" / "verdict.py"
    spec = importlib.util.spec_from_file_location("_rescue_verdict", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.stability_verdict


def weights_digest(weights: list[torch.Tensor]) -> str:
    flat = torch.cat([p.detach().reshape(-1).float() for p in weights])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]


def run_one(
    base,
    case: Case,
    arm: str,
    seed: int,
    steps: int,
    fp16_scale: float = 1.0,
    world: int = 1,
    rank: int = 0,
    engine_overrides: dict | None = None,
    full_weights=None,
) -> dict:
    """Fine-tune `base` under `case` with `arm`; the final eval loss (NaN when weights are non-finite) and counts.
    `engine_overrides`: TrainingArguments of a sharded engine (DeepSpeed, FSDP2), with `full_weights(model)` giving
    the gathered trainable weights for the digest."""
    from peft import LoraConfig, get_peft_model

    cpu0, wall0 = time.process_time(), time.perf_counter()
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    model.train()
    if arm in HF_ARMS:  # the recipe loads the model on hf_stable's attention (RunConfig().attention default)
        from hf_stable.attention import register

        register(hf_config(arm, steps).attention)
        model.set_attn_implementation("hf_stable")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    if case.precision == "fp16":
        emulate_fp16(model, fp16_scale)
    faults = Faults(model, case, steps, seed, rank)
    training = {
        "max_steps": steps,
        "learning_rate": CLEAN_LR * case.lr_mult,
        "seed": seed,
        "warmup_steps": case.warmup,
        "bf16": case.precision == "bf16",
        "per_device_train_batch_size": BATCH // world,
    }
    trainer_cls, callbacks, overrides, make_optimizer = _build(arm, model, case, steps, training)
    meter = LogitMeter(LOGIT_EVERY) if case.logits else None
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        args = training_args(tmp, **{**training, **overrides, **(engine_overrides or {})})
        optimizer = make_optimizer(args) if make_optimizer else None
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=train_rows(case, seed, steps * BATCH),
            eval_dataset=eval_rows(),
            callbacks=callbacks + ([meter] if meter else []),
            optimizers=(optimizer, None),
        )
        trainer.train()
        stopped = next((cb.stopped_at for cb in callbacks if getattr(cb, "stopped_at", None)), None)
        checkpoint = None
        if stopped is not None:  # a stopped run is judged by its last checkpoint
            checkpoint = next(cb for cb in callbacks if isinstance(cb, peers.Checkpoints)).restore()
        eval_loss = trainer.evaluate()["eval_loss"]
    weights = full_weights(model) if full_weights is not None else peers.trainable(model)
    if not all(bool(torch.isfinite(p).all()) for p in weights):
        eval_loss = float("nan")
    raised = _events(callbacks)
    events = [e["kind"] for e in raised]
    skips = events.count("step_skipped") + sum(getattr(cb, "skips", 0) for cb in callbacks)
    said = event_summary(raised, trainer.state.log_history) if arm in HF_ARMS else None
    logits = meter.values + [max_logit(model)] if meter else []
    return {
        "case": case.name,
        "arm": arm,
        "seed": seed,
        "eval_loss": eval_loss,
        "stopped": stopped,
        "checkpoint": checkpoint,
        "skips": skips,
        "rollbacks": events.count("rollback"),
        "events": said["kinds"] if said else None,
        "stability": said["verdict"] if said else None,
        "lr_factor": next((cb.product for cb in callbacks if hasattr(cb, "product")), 1.0),
        "faults": sorted(faults.at),
        "cpu_s": time.process_time() - cpu0,
        "wall_s": time.perf_counter() - wall0,
        "logit_final": logits[-1] if logits else math.nan,
        "logit_peak": max(logits) if logits else math.nan,
        "digest": weights_digest(weights),
    }
