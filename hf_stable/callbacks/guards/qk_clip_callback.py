"""`QKClipCallback`: after an optimizer step, pull layers whose max attention logit exceeded τ back under it.

The max logits come from the shared `LogitProbe`, armed for the sampled steps and fed during that step's
forward passes (all-reduced across ranks, so every rank rescales identically). The rescale happens in
`on_optimizer_step`, right after `optimizer.step()`, on the freshly updated weights. What it scales per
architecture (q/k projections, Qwen3's q/k norms, LoRA deltas) is documented in
`hf_stable.attention.qk_clip`.
"""

from __future__ import annotations

from hf_stable.attention.probe import LogitProbe, get_probe
from hf_stable.attention.qk_clip import attention_layers, frozen_norm_bound, layer_mode, qk_clip
from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.monitors.attention_monitor_callback import IMPLEMENTATION, sample_step
from hf_stable.compat import attn_implementation
from hf_stable.config.attention import AttentionConfig
from hf_stable.config.fields import config_from
from hf_stable.errors import ConfigError


class QKClipCallback(StabilityCallback):
    """Rescales query/key weights per head when a layer's sampled max attention logit exceeds `tau`.

    Args:
        config: the `AttentionConfig` section (default `AttentionConfig()`): `qk_clip_tau` (threshold on the max
            pre-softmax logit), `qk_clip_alpha` (share of the rescale on queries), `qk_clip_interval` (check every N
            optimizer steps and step 1; one extra q·k pass per layer), `qk_clip_on_lora` ("delta" scales the LoRA
            B rows of q_proj/k_proj when the base q/k are frozen: a frozen base that alone exceeds tau cannot be
            fixed, an `qk_clip_ineffective` event says so; "error" refuses).
        probe: the probe to arm (defaults to the process-wide one).
        enabled: False makes the callback a no-op.
        **overrides: `AttentionConfig` fields to change, e.g. `QKClipCallback(qk_clip_tau=100.0)`.

    Raises:
        ConfigError: at train start, `on_lora="error"` and the model's q/k are LoRA-adapted with a frozen base.

    Example:
        >>> Trainer(model, args, callbacks=[QKClipCallback(qk_clip_tau=100.0)], ...)  # model on attn "hf_stable"
    """

    def __init__(
        self,
        config: AttentionConfig | None = None,
        *,
        probe: LogitProbe | None = None,
        enabled: bool = True,
        **overrides,
    ):
        super().__init__(enabled=enabled)
        cfg = self.config = config_from(AttentionConfig, config, overrides)
        if cfg.qk_clip_on_lora not in ("delta", "error"):
            raise ConfigError(f"qk_clip_on_lora: got {cfg.qk_clip_on_lora!r}, allowed: 'delta', 'error'")
        self.tau = cfg.qk_clip_tau
        self.alpha = cfg.qk_clip_alpha
        self.interval = cfg.qk_clip_interval
        self.on_lora = cfg.qk_clip_on_lora
        self.probe = probe if probe is not None else get_probe()
        self._active = enabled
        self._total = 0
        self._last_clip: dict[int, tuple[int, float]] = {}  # layer -> (step, max logit that triggered it)
        self._warned: set[str] = set()

    def state_dict(self) -> dict:
        return {
            "total": self._total,
            "last_clip": {str(k): list(v) for k, v in self._last_clip.items()},
            "warned": sorted(self._warned),
        }

    def load_state_dict(self, state: dict) -> None:
        self._total = int(state.get("total", 0))
        self._last_clip = {int(k): (int(v[0]), float(v[1])) for k, v in state.get("last_clip", {}).items()}
        self._warned = set(state.get("warned", []))

    @property
    def total_clips(self) -> int:
        return self._total

    def _warn_once(self, key: str, step: int, kind: str, message: str, **fields) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.event(step, kind, message, **fields)

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if not self.enabled:
            return
        model = kwargs.get("model")
        impl = attn_implementation(model)
        self._active = impl == IMPLEMENTATION
        if not self._active:
            self._warn_once(
                "impl",
                state.global_step,
                "qk_clip_inactive",
                f"the model runs attn_implementation={impl!r}; QK-clip needs 'hf_stable'",
            )
            return
        for idx, attn in sorted(attention_layers(model).items()):
            mode, reason = layer_mode(attn)
            if mode == "lora" and self.on_lora == "error":
                raise ConfigError(
                    f"attention.qk_clip_on_lora: 'error' and layer {idx} has frozen q/k projections with LoRA "
                    "adapters; set qk_clip_on_lora: delta to scale the adapters' deltas, or turn qk_clip off"
                )
            if mode == "refused":
                bound = frozen_norm_bound(attn)
                extra = (
                    ""
                    if bound is None
                    else (
                        f"; the frozen norms bound |logit| by {bound:.1f}"
                        + (" (below tau: clipping is never needed)" if bound <= self.tau else " (above tau)")
                    )
                )
                self._warn_once(
                    f"refused:{reason}",
                    state.global_step,
                    "qk_clip_refused",
                    f"QK-clip cannot act on layer {idx}: {reason}{extra}",
                    severity="info" if bound is not None and bound <= self.tau else "warning",
                )

    def on_step_begin(self, args, state, control, **kwargs):
        if self._active and sample_step(state.global_step + 1, self.interval):
            self.probe.arm(state.global_step + 1)

    def on_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1  # global_step is incremented after this hook
        if not (self._active and self.probe.step == step and sample_step(step, self.interval)):
            return
        maxima = self.probe.read()
        results = qk_clip(kwargs["model"], maxima, tau=self.tau, alpha=self.alpha)
        clipped = 0
        for r in results:
            if r.action == "refused":
                self._warn_once(
                    f"refused:{r.reason}",
                    step,
                    "qk_clip_refused",
                    f"layer {r.layer} max logit {r.max_logit:.1f} > tau {self.tau:g} but QK-clip cannot "
                    f"act: {r.reason}",
                    group=f"layer_{r.layer}",
                    value=r.max_logit,
                    threshold=self.tau,
                )
                continue
            if r.action == "none":
                continue
            clipped += 1
            previous = self._last_clip.get(r.layer)
            if r.action == "lora" and previous is not None and r.max_logit >= previous[1]:
                self._warn_once(
                    f"ineffective:{r.layer}",
                    step,
                    "qk_clip_ineffective",
                    f"layer {r.layer}: max logit {r.max_logit:.1f} still > tau {self.tau:g} after scaling the LoRA "
                    f"delta at step {previous[0]} (was {previous[1]:.1f}); the frozen base q/k carry it. Use "
                    "attention.softcap, or a higher qk_clip_tau",
                    group=f"layer_{r.layer}",
                    value=r.max_logit,
                    threshold=self.tau,
                )
            self._last_clip[r.layer] = (step, r.max_logit)
            self.event(
                step,
                "qk_clip",
                f"layer {r.layer} max logit {r.max_logit:.1f} > tau {self.tau:g}: scaled {r.action} weights of "
                f"heads {r.heads} (factor {r.factor:.4f}, alpha {self.alpha:g})",
                group=f"layer_{r.layer}",
                value=r.max_logit,
                threshold=self.tau,
                severity="info",
                factor=r.factor,
                heads=r.heads,
                action=r.action,
            )
        self._total += clipped
        self.record({"attn/qk_clip/layers": float(clipped), "attn/qk_clip/total": float(self._total)})

    def on_step_end(self, args, state, control, **kwargs):
        if self.probe.step == state.global_step:
            self.probe.disarm()
        super().on_step_end(args, state, control, **kwargs)
