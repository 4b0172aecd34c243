"""`StepTap`: forward hooks on the training model that see what the Trainer does not pass to callbacks.

The Trainer hands callbacks neither the step's loss nor its batch. Two module hooks on the (unwrapped) model
recover both, at the cost of one Python call per forward and no device sync:

* the **loss** of every training micro-batch, accumulated on device and attached to the step's single
  `GradStats` transfer (summed over ranks there). Unlike the Trainer's logged `loss`, it is per step and is
  not hidden when non-finite (`logging_nan_inf_filter` replaces a NaN loss by the running mean);
* the **inputs** of every micro-batch (references, no copy), so the non-finite locator can re-run the step;
* the **token count** (input shape, padding included; exact for padding-free packed batches);
* the **record ids** of every micro-batch (``record_ids``, which `StableTrainer` takes out of the inputs before
  the forward and hands over with `note_record_ids`), aligned with `inputs`, for the spike forensics.

Only forwards in training mode with grad enabled are recorded (evaluation and generation are ignored).

A trainer whose objective is not the model's LM loss (DPO, KTO, GRPO ...: `hf_stable.stabilize`) binds its
`compute_loss` with `judge_objective`: the step loss is then the mean of what `compute_loss` returned per micro-batch
(the number the Trainer logs as ``loss``), the recorded inputs are the trainer-level ones, and every re-run
(`batch_gradients`: the rollback's check, the non-finite locator, the forensics) goes through `compute_loss` too. The
model's own ``.loss`` (e.g. the NLL TRL asks for while computing log-probs) is then ignored.

Loss arithmetic: the step loss is the token-weighted mean over the whole global batch, independent of how the
Trainer scales things. For each micro-batch the hook turns the model's loss back into a token *sum*: times
`num_items_in_batch` when the Trainer passed it (the model then returns `sum / num_items`), else times the
number of supervised tokens (`labels[..., 1:] != -100`, a mean loss). Sums and token counts are added on device
and summed over ranks in the `GradStats` transfer: `loss = loss_num / loss_den`. Without labels in the inputs
(a custom `compute_loss`) each micro-batch loss counts once (mean of micro-batch losses).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from hf_stable.core.model_table import ModelTable

_SHARED = ModelTable()
RECORD_IDS_KEY = "record_ids"  # the batch key the train collators use (see hf_stable.data.identity)


def _loss_of(output):
    if isinstance(output, torch.Tensor):  # a bound objective's `compute_loss` returns the loss itself
        loss = output
    elif isinstance(output, dict) or hasattr(output, "keys"):
        loss = output.get("loss") if hasattr(output, "get") else None
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0] if output[0].dim() == 0 else None
    else:
        loss = None
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class StepTap:
    """Records the training step's inputs, token count and loss through forward hooks on `model`.

    Args:
        model: the unwrapped model the Trainer trains (the callback kwarg `model`).

    Example:
        >>> tap = StepTap.shared(model)
        >>> tap.attach()
    """

    def __init__(self, model: torch.nn.Module):
        self._model_ref = weakref.ref(model)
        self._handles: list = []
        self._paused = False
        self.inputs: list[tuple[tuple, dict]] = []
        self.record_ids: list[torch.Tensor | None] = []  # per entry of `inputs`
        self._pending_ids: torch.Tensor | None = None
        self.tokens = 0
        self._num: torch.Tensor | None = None
        self._den = 0.0
        self.n_losses = 0
        self._stats = None  # the model's GradStats, which transfers our loss sums
        self._output_listeners: list = []
        self._logit_readers: list = []  # listeners that need output.logits (not output.chunked)
        self._row_fns: list = []
        self.objective = None  # `judge_objective`: fn(call_args, call_kwargs) -> loss, the trainer's compute_loss

    @classmethod
    def shared(cls, model: torch.nn.Module) -> StepTap:
        tap = _SHARED.get(model)
        if tap is None:
            tap = _SHARED[model] = cls(model)
        return tap

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> StepTap:
        """Register the hooks once (idempotent) and hook the loss into `GradStats.shared(model)`."""
        model = self._model_ref()
        if model is None or self._handles:
            return self
        self._handles = [
            model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            model.register_forward_hook(self._post_hook, with_kwargs=True),
        ]
        from hf_stable.core.grad_stats import GradStats

        self._stats = GradStats.shared(model)
        self._stats.add_source("step_tap", self.device_scalars)
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def begin_step(self) -> None:
        """Forget the previous step (called from `on_step_begin`; calling it twice is harmless)."""
        self.inputs = []
        self.record_ids = []
        self.tokens = 0
        self._num, self._den, self.n_losses = None, 0.0, 0
        if self._stats is not None:
            self._stats.begin_step()

    @contextlib.contextmanager
    def paused(self):
        """Do not record forwards inside this block (used by re-runs)."""
        old, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = old

    @contextlib.contextmanager
    def replaying(self):
        """Context for re-running the step's captured micro-batches (`self.inputs`): recording paused, the RNG
        forked (the run's randomness unchanged), grad enabled (hooks run with it on or off)."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with self.paused(), torch.random.fork_rng(devices=devices), torch.enable_grad():
            yield

    def judge_objective(self, fn) -> None:
        """Judge the trainer's objective instead of the model's ``.loss``: `fn(call_args, call_kwargs)` re-computes a
        recorded micro-batch's loss (the trainer's `compute_loss` on its inputs); the trainer reports each training
        micro-batch with `note_objective`. None: back to the model's loss."""
        self.objective = fn

    def note_objective(self, loss, inputs, record_ids: torch.Tensor | None = None) -> None:
        """A training micro-batch's objective `loss` (what `compute_loss` returned), its trainer-level `inputs` and
        its `record_ids`, recorded as the model's forward would be (not while paused, in evaluation or without
        grad)."""
        model = self._model_ref()
        if self._paused or model is None or not model.training or not torch.is_grad_enabled():
            return
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        self.inputs.append(((), inputs))
        self.record_ids.append(record_ids)
        loss = loss.detach().to(torch.float32).reshape(())
        one = torch.ones_like(loss)
        self._den = one if self._num is None else self._den + one
        self._num = loss if self._num is None else self._num + loss
        self.n_losses += 1

    def add_output_listener(self, fn, reads_chunks: bool = False, row_fn=None) -> None:
        """`fn(kwargs, output, record_ids)` after every recorded training forward (e.g. per-sample screening, which
        reads the logits the forward produced); registering the same function twice has no effect.

        `reads_chunks`: `fn` also takes the output of a chunked training forward (`hf_stable.loss`: no
        ``logits``, ``output.chunked`` holds the supervised tokens' NLL); without it, registering `fn` keeps the
        model's full-logits forward for training. `row_fn`: a per-token statistic `fn` wants computed on each
        chunk's logits (``output.chunked.row_stats[row_fn]``)."""
        if fn in self._output_listeners:
            return
        self._output_listeners.append(fn)
        if not reads_chunks:
            self._logit_readers.append(fn)
        if row_fn is not None:
            self._row_fns.append(row_fn)

    @property
    def reads_logits(self) -> bool:
        """True when an output listener needs the training forwards' whole logits (they must then be built)."""
        return bool(self._logit_readers)

    @property
    def row_fns(self) -> tuple:
        """The per-token statistics the listeners want from a chunked loss's chunks."""
        return tuple(self._row_fns)

    def note_record_ids(self, record_ids: torch.Tensor | None) -> None:
        """The record ids of the micro-batch about to be forwarded (kept with its inputs by the next forward)."""
        self._pending_ids = record_ids

    def _recording(self, module) -> bool:
        return not self._paused and module.training and torch.is_grad_enabled()

    def _pre_hook(self, module, args, kwargs):
        pending, self._pending_ids = self._pending_ids, None
        if not self._recording(module):
            return
        if self.objective is None:  # else the trainer-level inputs are recorded (`note_objective`)
            self.inputs.append((args, kwargs))
            self.record_ids.append(pending)
        ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        if isinstance(ids, torch.Tensor):
            self.tokens += ids.numel()
        elif isinstance(kwargs.get("inputs_embeds"), torch.Tensor):
            self.tokens += int(kwargs["inputs_embeds"].shape[:-1].numel())
        return

    def _post_hook(self, module, args, kwargs, output):
        if not self._recording(module) or self.objective is not None:
            return
        for fn in self._output_listeners:
            fn(kwargs, output, self.record_ids[-1] if self.record_ids else None)
        loss = _loss_of(output)
        if loss is None:
            return
        with torch.no_grad():  # (no `detach` op per forward: nothing below is recorded)
            self._add_loss(loss.to(torch.float32), kwargs, getattr(getattr(output, "chunked", None), "rows", None))
        self.n_losses += 1

    def _add_loss(self, loss: torch.Tensor, kwargs: dict, rows: torch.Tensor | None = None) -> None:
        """`rows`: the supervised positions a chunked loss listed (`hf_stable.loss.ChunkedLoss.rows`): their count is
        the supervised-token count, already on the host (no device op, the same number as counting the labels)."""
        loss = loss if loss.dim() == 0 else loss.reshape(())
        if isinstance(rows, torch.Tensor):
            tokens = float(rows.numel())
        else:
            labels = kwargs.get("shift_labels")
            if not isinstance(labels, torch.Tensor):
                labels = kwargs.get("labels")
                labels = labels[..., 1:] if isinstance(labels, torch.Tensor) and labels.dim() >= 1 else None
            tokens = labels.ne(-100).sum().to(torch.float32) if labels is not None else torch.ones_like(loss)
        num_items = kwargs.get("num_items_in_batch")
        if num_items is not None:  # the model returned sum / num_items
            weight = num_items.to(loss.device, torch.float32) if isinstance(num_items, torch.Tensor) else num_items
        else:  # the model returned a mean over its supervised tokens (or, without labels, count it once)
            weight = tokens
        total = loss * weight
        self._den = tokens if self._num is None else self._den + tokens  # a host count or a device tensor
        self._num = total if self._num is None else self._num + total

    def device_scalars(self) -> dict[str, torch.Tensor | float]:
        """`loss_num` and `loss_den` as device tensors (`loss_den` a host number when the chunked loss counted its
        tokens); zeros when no loss was seen (the keys are always there, so every rank joins the same all-reduce)."""
        if self._num is None:
            model = self._model_ref()
            device = next(model.parameters()).device if model is not None else torch.device("cpu")
            zero = torch.zeros((), dtype=torch.float32, device=device)
            return {"loss_num": zero, "loss_den": zero}
        den = self._den  # a host count (`GradStats` sends it without making a tensor) or a device tensor
        return {"loss_num": self._num, "loss_den": den.to(self._num.device) if isinstance(den, torch.Tensor) else den}


def batch_gradients(model, params: list[torch.Tensor], call_args, call_kwargs, args=None):
    """(loss, gradients of `params`) of one captured micro-batch, by `torch.autograd.grad` (`.grad` untouched),
    the forward under the Trainer's autocast for `args`; unused parameters get zeros. (None, None) when the model
    returns no loss. A bound objective (`StepTap.judge_objective`) is re-run through the trainer's `compute_loss`.
    Use inside `StepTap.replaying()`."""
    from hf_stable.precision import training_autocast

    device = params[0].device if params else torch.device("cpu")
    objective = StepTap.shared(model).objective
    with training_autocast(args, device):
        loss = _loss_of(
            objective(call_args, call_kwargs) if objective is not None else model(*call_args, **call_kwargs)
        )
    if loss is None:
        return None, None
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss, [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params, strict=False)]


class StepTapUser:
    """Mixin for callbacks that read the step's inputs/loss through the shared `StepTap`.

    Call `self._use_step_tap(model)` from `on_train_begin` (None: do not use it this run); the tap is then reset
    at every `on_step_begin` while the callback is enabled. Several users share one tap, so attaching and
    resetting are idempotent.
    """

    _tap: StepTap | None = None

    def _use_step_tap(self, model) -> StepTap | None:
        self._tap = StepTap.shared(model).attach() if model is not None else None
        return self._tap

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        if self.enabled and self._tap is not None:
            self._tap.begin_step()
