"""Peer stability mechanisms for the rescue benchmark, each written from its published rule (no code copied).

Every peer runs in a stock `Trainer` with `max_grad_norm=0`: the callback reads the pre-clip global grad norm (as
the peers do), decides, then clips to 1.0 exactly like the Trainer's own `clip_grad_norm_`, unless its rule
replaces that clip. Decisions use rank-agreed values (the loss is averaged over ranks, as OLMo-core does; DDP
gradients are already averaged). A skip drops every gradient (`p.grad = None`: AdamW leaves moments, weight decay
and step count alone), a stop also drops them, then ends training before the update.

* `OlmoSkipStep` - OLMo-core `SkipStepOptimizer` (src/olmo_core/optim/skip_step_optimizer.py, read at
  allenai/OLMo-core HEAD): skip when loss - mean > 6 std or grad norm - mean > 6 std over the previous <= 128
  steps, judged once the history holds >= 64 values (rolling_interval_length // 2). Assumption: non-finite values
  are skipped and kept out of the history (OLMo-core's trainer instead raises on a non-finite loss).
* `NonFiniteStop` - torchtitan `Trainer.train_step` (torchtitan/trainer.py: loss finite on every rank and grad
  norm finite, else `_assert_async` stops before `optimizers.step()`) and Megatron-LM's fatal NaN/Inf loss check
  (pretrain_gpt.py, `validate_result(..., fatal=True)`). Megatron's opt-in spiky-loss check (loss >= 10x the max
  of the first 100 losses, megatron/core/rerun_state_machine.py `is_unexpectedly_large`) is non-fatal: the
  iteration is re-run and training continues; we count those flags and do not act on them.
* `ZClip` - arXiv 2504.02507 and bluorion-com/ZClip zclip/zclip.py: 25 warm-up norms give the EMA mean/variance;
  then z = (g - mean) / std, and above z_thresh 2.5 the norm is clipped to mean + z_thresh^2 * std / z
  ("adaptive_scaling", the reciprocal rule); the clipped value updates the EMA (alpha 0.97); max_grad_norm 1.0
  stays an outer cap. No non-finite handling (a NaN norm passes through).
* `SpamAdamW` - arXiv 2501.06842 and TianjinYellow/SPAM-Optimizer galore_torch/SPAM.py: AdamW whose first and
  second moments are zeroed every `interval` steps, followed by a cosine warm-up of the update scale (0.01 -> 1
  over `warmup` steps); between resets, once `clip_after` steps passed since one, an element with
  g^2 > threshold * v is set to sign(g) * sqrt(threshold * v) (threshold 5000); eps 1e-6. Their recipes use no
  global clip (grad_clipping 0). Assumption: their interval 500 / warm-up 150 are for 10k-60k-step runs; we keep
  the ratio at our length (interval = steps // 2, warm-up 0.3x that) so one reset happens mid-run.
* `LossWatchdog` - axolotl `LossWatchDogCallback` (src/axolotl/utils/callbacks/__init__.py): at each step end, if
  the last logged loss > threshold, count a violation (else reset); after `patience` (3) in a row, stop. We use
  their examples' threshold, 5.0 (examples/llama-3/lora-1b-kernels.yml and others), and log every step. A lower
  one is no better here: the first steps' loss sits at the base's (4.25), so any threshold under it stops clean
  runs at step 4 (seen with 4.25), and a diverged run of this task sits near 4.6, under the uniform guess (4.85).
* `Checkpoints` - periodic checkpoints, emulated by copies of the trainable weights: a stopped run reports the
  eval loss of its last checkpoint.
"""

from __future__ import annotations

import math
import statistics

import torch
from transformers import TrainerCallback

WATCHDOG_THRESHOLD = 5.0


# --- shared pieces -----------------------------------------------------------------------------------------------
def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def drop_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def rank_mean(x: float) -> float:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / dist.get_world_size()
    return x


def clip_(model, max_norm: float, norm: torch.Tensor) -> None:
    """The second half of `clip_grad_norm_` (the Trainer's clip), bitwise, with the norm already computed."""
    torch.nn.utils.clip_grads_with_norm_(trainable(model), max_norm, norm)


class LossTap:
    """Forward hook keeping the loss of the Trainer's last training forward (one micro-batch per step here)."""

    def __init__(self, model):
        self.loss = float("nan")
        model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            self.loss = float(output["loss"].detach())


class PeerCallback(TrainerCallback):
    """Reads the step's rank-mean loss and pre-clip grad norm, lets `decide` act, then clips (if `clip`)."""

    clip: float | None = 1.0

    def __init__(self):
        self.skips = 0
        self.stopped_at: int | None = None
        self.tap: LossTap | None = None

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.tap = LossTap(model)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        grads = [p.grad for p in trainable(model) if p.grad is not None]
        self.norm = torch.nn.utils.get_total_norm(grads)  # as clip_grad_norm_ computes it
        action = self.decide(state.global_step + 1, rank_mean(self.tap.loss), float(self.norm), model)
        if action in ("skip", "stop"):
            drop_grads(model)
            self.skips += action == "skip"
            if action == "stop":
                self.stopped_at = state.global_step + 1
                control.should_training_stop = True
        elif self.clip is not None:
            clip_(model, self.clip, self.norm)

    def decide(self, step: int, loss: float, norm: float, model) -> str | None:
        raise NotImplementedError


# --- OLMo-core ---------------------------------------------------------------------------------------------------
class OlmoSkipStep(PeerCallback):
    def __init__(self, window: int = 128, sigma: float = 6.0):
        super().__init__()
        self.window, self.sigma = window, sigma
        self.losses: list[float] = []
        self.norms: list[float] = []

    def decide(self, step, loss, norm, model):
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return "skip"
        for hist, x in ((self.losses, loss), (self.norms, norm)):
            hist.append(x)
            del hist[: -(self.window + 1)]
        if len(self.losses) < max(2, self.window // 2):
            return None
        for hist in (self.losses, self.norms):
            prev = hist[:-1]
            if hist[-1] - statistics.fmean(prev) > self.sigma * statistics.stdev(prev):
                return "skip"
        return None


# --- torchtitan / Megatron ---------------------------------------------------------------------------------------
class NonFiniteStop(PeerCallback):
    def __init__(self, spiky_factor: float = 10.0, spiky_samples: int = 100):
        super().__init__()
        self.spiky_factor, self.spiky_samples = spiky_factor, spiky_samples
        self.seen, self.max_loss, self.spiky_flags = 0, 0.0, 0

    def decide(self, step, loss, norm, model):
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return "stop"
        if self.seen < self.spiky_samples:
            self.seen += 1
            self.max_loss = max(self.max_loss, abs(loss))
        elif abs(loss) >= self.spiky_factor * self.max_loss:
            self.spiky_flags += 1  # Megatron re-runs the iteration and continues (non-fatal)
        return None


# --- ZClip -------------------------------------------------------------------------------------------------------
class ZClip(PeerCallback):
    clip = None  # its own rule clips

    def __init__(
        self, alpha: float = 0.97, z_thresh: float = 2.5, warmup: int = 25, max_norm: float = 1.0, eps: float = 1e-6
    ):
        super().__init__()
        self.alpha, self.z_thresh, self.warmup, self.max_norm, self.eps = alpha, z_thresh, warmup, max_norm, eps
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var = 0.0
        self.clips = 0

    def decide(self, step, loss, norm, model):
        if self.mean is None:
            self.buffer.append(norm)
            if len(self.buffer) >= self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
            clip_(model, self.max_norm, self.norm)
            return
        std = self.var**0.5
        z = (norm - self.mean) / (std + self.eps)
        target = self.mean + self.z_thresh**2 * std / z if z > self.z_thresh else None
        self.clips += target is not None
        clip_(model, min(target if target is not None else norm, self.max_norm), self.norm)
        seen = target if target is not None else norm
        self.mean = self.alpha * self.mean + (1 - self.alpha) * seen
        self.var = self.alpha * self.var + (1 - self.alpha) * (seen - self.mean) ** 2
        return


# --- SPAM --------------------------------------------------------------------------------------------------------
class SpamAdamW(torch.optim.Optimizer):
    """AdamW with periodic moment resets, a cosine update warm-up after each, and spike-aware element clipping."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        interval: int = 500,
        warmup: int = 150,
        threshold: float = 5000.0,
        clip_after: int = 20,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.interval, self.warmup, self.threshold, self.clip_after = interval, warmup, threshold, clip_after
        self.done = 0  # optimizer steps taken
        self.since_reset: int | None = None  # None: no reset yet (no warm-up at the very start)
        self.clipped = 0

    def _scale(self) -> float:
        if self.since_reset is None or self.since_reset >= self.warmup:
            return 1.0
        return 1.0 - 0.99 * (1 + math.cos(math.pi * self.since_reset / (self.warmup + 1))) / 2

    @torch.no_grad()
    def step(self, closure=None):
        n = self.done + 1  # 1-based index of this step
        reset = n % self.interval == 0
        if reset:
            self.since_reset = 0
        clip = n >= self.clip_after and n % self.interval >= self.clip_after
        scale = self._scale()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if not st or reset:
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                    st.setdefault("t", 0)
                st["t"] += 1
                m, v = st["m"], st["v"]
                if clip and self.threshold:
                    spike = g * g > self.threshold * v
                    if bool(spike.any()):
                        self.clipped += int(spike.sum())
                        g = torch.where(spike, g.sign() * (self.threshold * v).sqrt(), g)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step_size = group["lr"] * math.sqrt(1 - beta2 ** st["t"]) / (1 - beta1 ** st["t"])
                p.add_(m / (v.sqrt() + group["eps"]), alpha=-step_size * scale)
                if group["weight_decay"]:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])
        self.done += 1
        if self.since_reset is not None:
            self.since_reset += 1


# --- Axolotl -----------------------------------------------------------------------------------------------------
class LossWatchdog(TrainerCallback):
    def __init__(self, threshold: float, patience: int = 3):
        self.threshold, self.patience = threshold, patience
        self.violations = 0
        self.stopped_at: int | None = None
        self.skips = 0

    def on_step_end(self, args, state, control, **kw):
        if state.log_history and "loss" in state.log_history[-1]:
            if state.log_history[-1]["loss"] > self.threshold:
                self.violations += 1
                if self.violations >= self.patience:
                    control.should_training_stop = True
                    self.stopped_at = state.global_step
            else:
                self.violations = 0


# --- checkpoints -------------------------------------------------------------------------------------------------
class Checkpoints(TrainerCallback):
    """Copies of the trainable weights every `every` steps (and at the start); `restore()` loads the last one."""

    def __init__(self, model, every: int = 25):
        self.model, self.every = model, every
        self.step, self.saved = 0, self._copy()

    def _copy(self):
        return [p.detach().clone() for p in trainable(self.model)]

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % self.every == 0:
            self.step, self.saved = state.global_step, self._copy()

    @torch.no_grad()
    def restore(self) -> int:
        for p, saved in zip(trainable(self.model), self.saved, strict=False):
            p.copy_(saved)
        return self.step
