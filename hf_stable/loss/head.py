"""`chunked_training_forward`: the causal-LM model's forward, for the duration of a block, computes its loss with
`chunked_cross_entropy` instead of building the whole logits.

The Trainer calls the top-level module (``DDP(PeftModel(LlamaForCausalLM))``): its forward must run so that DDP's
hooks fire, FSDP2's root unshards and accelerate's autocast applies, and the `StepTap` hooks on the unwrapped model
see the step's loss. So the innermost ``*ForCausalLM`` module gets an instance ``forward`` for the block (as TRL's
``add_fused_lm_head`` patches it): its body (``model.base_model``) runs to hidden states and the head module
(``get_output_embeddings()``, with peft's LoRA or ``modules_to_save`` wrapper in place) is called chunk by chunk.
Everything on the way (peft, DDP, accelerate) passes the output through. A `transformers.Trainer`'s
``compute_loss_func`` cannot do this: it receives the logits after the model's forward has built them.

The returned `ChunkedCausalLMOutput` has ``loss`` and no ``logits``; ``chunked`` holds the per-token NLL (and the
row statistics asked for) of the supervised positions. A call the chunked path does not cover (no labels, positional
arguments, ``logits_to_keep``, ``return_dict=False``) goes to the model's own forward; so does every call outside
the block (evaluation, generation, the forensics' re-runs). Under ZeRO-3 or FSDP2 a trainable head's parameters are
not what the module computes with outside its forward (`StepEngine.params_outside_forward`): there the chunks run by
plain autograd under `torch.utils.checkpoint`, the backward calling the head module again. Where the engine gathers
the head per call (``forward_is_collective``), the ranks agree on the chunk count first (one all-reduce).

Example (a stock `Trainer` user):
    >>> class ChunkedTrainer(Trainer):
    ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    ...         with chunked_training_forward(model, TrainingLossConfig()) if model.training else nullcontext():
    ...             return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from hf_stable.config.loss import TrainingLossConfig
from hf_stable.loss.chunked import ChunkedLoss, RowFn, chunked_cross_entropy

# config keys of models whose forward scales the logits after the head (TRL's fused head lists the same ones): their
# forward is not the plain head + cross-entropy, so they keep it
_LOGIT_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


@dataclass
class ChunkedCausalLMOutput(ModelOutput):
    """A causal-LM output without logits: ``loss`` and the chunks' per-token values (`ChunkedLoss`)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    chunked: ChunkedLoss | None = None


@dataclass
class ChunkedRun:
    """The block's settings and what happened: `calls` counts the forwards that took the chunked path."""

    chunk_size: int
    z_loss: float
    softcap: float | None
    row_fns: Sequence[RowFn] = ()
    calls: int = 0
    collective_head: bool = False  # the head's weights are gathered per call (ZeRO-3, FSDP2): chunk counts agree
    checkpointed: bool = False  # chunks by checkpointed autograd (`chunked_cross_entropy`'s `checkpointed`)


_UNWRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The innermost ``*ForCausalLM`` module under DDP / DeepSpeed / compile wrappers and a peft model; None when
    there is none."""
    from accelerate.utils import extract_model_from_parallel

    # accelerate's unwrap walks every module (its compiled-regions check); a wrapper keeps the module it wraps, so
    # it is walked once per wrapper, not once per training step
    # (the value is a weak reference too: the unwrapped module is often the key itself)
    ref = _UNWRAPPED.get(model)
    inner = ref() if ref is not None else None
    if inner is None:
        inner = extract_model_from_parallel(model)
        _UNWRAPPED[model] = weakref.ref(inner)
    get_base = getattr(inner, "get_base_model", None)  # peft's PeftModel
    if callable(get_base):
        inner = get_base()
    return inner if type(inner).__name__.endswith("ForCausalLM") else None


def unsupported_reason(inner: torch.nn.Module | None) -> str | None:
    """Why `inner`'s forward is not a body + head + ``ForCausalLMLoss`` the chunked loss can stand in for; None
    when it is."""
    if inner is None:
        return "not a *ForCausalLM model"
    if getattr(inner, "base_model", inner) is inner or inner.get_output_embeddings() is None:
        return f"{type(inner).__name__} has no separate body and LM head"
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    scales = [k for k in _LOGIT_SCALES if getattr(config, k, None) not in (None, 1, 1.0)]
    if scales:
        return f"{type(inner).__name__} scales its logits ({', '.join(scales)})"
    if getattr(config, "output_router_logits", False):
        return f"{type(inner).__name__} adds a router loss"
    if "_loss_function" in vars(inner) or getattr(inner, "loss_type", None) not in (None, "ForCausalLM"):
        return f"{type(inner).__name__} uses its own loss function"
    return None


def _softcap(inner) -> float | None:
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def _max_over_ranks(n: int) -> int:
    from hf_stable.distributed import all_reduce_scalar

    return int(all_reduce_scalar(n, "max"))


def _forward(inner, original, run: ChunkedRun, *args, labels=None, logits_to_keep=0, **kwargs):
    plain = (
        args
        or (labels is None and kwargs.get("shift_labels") is None)
        or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
        or kwargs.get("return_dict") is False
    )
    if plain:
        return original(*args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    kwargs.pop("return_dict", None)
    body = dict(kwargs)  # a loop, not a comprehension over items(): dynamo cannot iterate dict items in one
    for key in ("output_attentions", "output_hidden_states"):
        if key in body and body[key] is None:
            del body[key]
    outputs = inner.base_model(**body)
    return _chunked_output(inner, run, outputs, labels, shift_labels, num_items)


@torch.compiler.disable
def _chunked_output(inner, run: ChunkedRun, outputs, labels, shift_labels, num_items) -> ChunkedCausalLMOutput:
    """The loss from the body's hidden states, kept out of a compiled graph (``training.torch_compile``): the
    supervised rows it selects are a new count every step (a data-dependent shape dynamo cannot trace without
    a graph break and a recompilation per count), so under torch.compile the body is one graph and the loss runs
    eagerly after it, as it does without compilation."""
    out = chunked_cross_entropy(
        outputs.last_hidden_state,
        inner.get_output_embeddings(),
        labels,
        shift_labels=shift_labels,
        num_items_in_batch=num_items,
        chunk_size=run.chunk_size,
        softcap=run.softcap,
        z_loss=run.z_loss,
        row_fns=run.row_fns,
        agree_chunks=_max_over_ranks if run.collective_head else None,
        checkpointed=run.checkpointed,
    )
    run.calls += 1
    return ChunkedCausalLMOutput(
        loss=out.loss,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        chunked=out,
    )


@contextlib.contextmanager
def chunked_training_forward(
    model: torch.nn.Module, cfg: TrainingLossConfig, row_fns: Sequence[RowFn] = ()
) -> contextlib.AbstractContextManager[ChunkedRun | None]:
    """Inside the block, forwards of `model` with labels compute the loss in chunks (see the module docstring).

    Args:
        model: the model the Trainer calls (wrappers and peft included).
        cfg: `TrainingLossConfig` (``chunked: false``: the block changes nothing).
        row_fns: per-token statistics to read from the chunks' logits (`chunked_cross_entropy`).

    Yields:
        A `ChunkedRun` (its `calls` counts chunked forwards), or None when the model's forward stays (the model
        does not fit: `unsupported_reason`, or ``chunked: false``).
    """
    inner = causal_lm_of(model) if cfg.chunked else None
    if inner is None or unsupported_reason(inner) is not None:
        yield None
        return
    from hf_stable.core.engine import StepEngine

    engine = StepEngine.of(model)
    trainable_head = any(p.requires_grad for p in inner.get_output_embeddings().parameters())
    run = ChunkedRun(
        cfg.chunk_size,
        cfg.z_loss,
        _softcap(inner),
        row_fns,
        collective_head=engine.forward_is_collective,
        # ZeRO-3 / FSDP2 and a trainable head (LoRA / modules_to_save on lm_head): see `StepEngine`
        checkpointed=trainable_head and not engine.params_outside_forward,
    )
    saved = vars(inner).get("forward")  # an instance forward already there (another patch) is restored after
    original = inner.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return _forward(inner, original, run, *args, **kwargs)

    inner.forward = forward
    try:
        yield run
    finally:
        if saved is not None:
            inner.forward = saved
        else:
            del inner.forward
