"""The `hf_stable` attention implementation: flash-attn / SDPA / explicit fp32 softmax, soft-capping,
a sampled max-logit probe and QK-clip. Call `register()` before loading a model with
`attn_implementation="hf_stable"`; importing this package registers nothing."""

from hf_stable.attention.interface import (
    ATTN_IMPLEMENTATION,
    backend_usage,
    hf_stable_attention_forward,
    is_registered,
    register,
    reset_backend_usage,
)
from hf_stable.attention.probe import LogitProbe, get_probe, head_max_logits
from hf_stable.attention.qk_clip import ClipResult, attention_layers, clip_layer, layer_mode, qk_clip
from hf_stable.attention.settings import AttentionSettings, configure, current_settings, use_settings

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionSettings",
    "ClipResult",
    "LogitProbe",
    "attention_layers",
    "backend_usage",
    "clip_layer",
    "configure",
    "current_settings",
    "get_probe",
    "head_max_logits",
    "hf_stable_attention_forward",
    "is_registered",
    "layer_mode",
    "qk_clip",
    "register",
    "reset_backend_usage",
    "use_settings",
]
