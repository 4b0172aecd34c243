"""`StableTrainer`: a `transformers.Trainer` whose gradient norm comes from the monitors' single `GradStats` pass.

Every hf_stable callback works in a stock `Trainer`; this subclass removes what the stock one does twice or hides:

* `_clip_grad_norm` / `_get_grad_norm` use the step's shared `GradStats` (one foreach pass read by the monitors and
  guards too) instead of reading every gradient again; the clip uses torch's coefficient `max_norm / (norm + 1e-6)`
  after the statistics, so monitors report pre-clip numbers. A gradient changed later by a callback invalidates
  them (version counters), so guards judge what the optimizer applies. A non-finite norm leaves the gradients as
  they are (the stock clip turns every gradient NaN and hides which parameter went bad).
* Reporting integrations run after our callbacks (`order_for_reporting`), so they log hf_stable's metrics.
* hf_stable callbacks' resume state is written into the `TrainerState` just before each checkpoint (and at train
  end), not at every step's end as in a stock Trainer, which gives callbacks no hook before it saves.
* The batch's ``record_ids`` (`data.identity`) are popped before the forward and handed to the `StepTap` for the
  spike forensics - only when hf_stable's own collator (which this trainer asked for them) made the batch; another
  collator's ``record_ids`` are the user's and reach the model untouched. The train sampler skips quarantined
  records (`forensics.quarantine`).
* Training steps compute the loss with `hf_stable.loss` (``training_loss.chunked``, the default): the LM head and the
  cross-entropy over chunks of the supervised positions, so the ``[tokens, vocab]`` logits are never held. Where
  logits are asked for (``return_outputs``, `prediction_step` / evaluation, a `StepTap` output listener that reads
  logits) the model's own forward runs; the forensics' screening reads its per-sample statistics from the chunks. A
  ``compute_loss_func`` or label smoothing keeps the model's forward too.
* With a guard that changes gradient accumulation (batch warmup, thermal), the sampler is an `EpochStreamSampler`
  holding every micro-batch the plan can ask for, and a resume skips the micro-batches really consumed (not
  `global_step x accumulation`), so it continues bit for bit.

* Sharded engines (`core.engine`): under FSDP2 the norm is the shared statistics' sum over the ranks' shards (one
  collective); under DeepSpeed, which steps inside `accelerator.backward`, the callbacks' `on_pre_optimizer_step` runs
  between the engine's backward and its step (where ZeRO's partitions hold the reduced gradients), the engine
  then skips a step the guards skipped and keeps the LR schedule on `global_step` (`DeepSpeedEngine.step`), and the
  Trainer's own later `on_pre_optimizer_step` call is not repeated. The stock `Trainer` cannot host that: its
  callbacks see the step after DeepSpeed made it, so hf_stable's guards say so once and stay off there.

XLA, mixed device meshes and SageMaker MP fall back to the stock methods.

`hf_stable.stabilize(trainer)` gives a trainer built elsewhere (TRL's DPO, KTO, GRPO ...) all of this by making its
class a subclass of this one and of its own (`_stable_setup` is what `__init__` adds); for an objective that is not
the model's LM loss it binds the model's `StepTap` to what `compute_loss` returns (`StepTap.judge_objective`), which
`compute_loss` here reports for every training micro-batch.

Example:
    >>> trainer = StableTrainer(model=model, args=args, train_dataset=ds, callbacks=build_callbacks(cfg, args))
"""

from __future__ import annotations

import contextlib
import math

import torch
from transformers import Trainer
from transformers.trainer_utils import has_length

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.callbacks.guards.accumulation_control import AccumulationControl
from hf_stable.callbacks.ordering import order_for_reporting, skip_noop_hooks
from hf_stable.callbacks.spike_forensics import wrap_train_sampler
from hf_stable.compat import foreach_mul_, has_mixed_mesh_grads
from hf_stable.config.loss import TrainingLossConfig
from hf_stable.core.engine import DeepSpeedEngine, StepEngine, refuse_fsdp1
from hf_stable.core.grad_stats import GradStats
from hf_stable.core.step_tap import RECORD_IDS_KEY, StepTap
from hf_stable.data.epochs import EpochStreamSampler
from hf_stable.loss import chunked_training_forward


class StableTrainer(Trainer):
    """`Trainer` that computes the step's gradient norm (and clip) from the shared `GradStats` pass.

    Args:
        training_loss: how training steps compute the loss (`TrainingLossConfig`; default: chunked).
        *args, **kwargs: those of `transformers.Trainer`.
    """

    def __init__(self, *args, training_loss: TrainingLossConfig | None = None, **kwargs):
        # FSDP1 is refused before accelerate builds its plugin (which on CPU ranks fails for FSDP1, less clearly)
        refuse_fsdp1(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        self._stable_setup(training_loss)

    def _stable_setup(self, training_loss: TrainingLossConfig | None = None) -> None:
        """What this class adds to a built trainer (also run by `hf_stable.stabilize` on a trainer built elsewhere)."""
        self.training_loss = training_loss if training_loss is not None else TrainingLossConfig()
        order_for_reporting(self)  # reporters (TensorBoard, W&B ...) after the callbacks whose metrics they write
        skip_noop_hooks(self.callback_handler)  # the ~20 callbacks' no-op hooks are not called at every event
        if self.model is not None:  # tells the monitors their numbers are pre-clip even with max_grad_norm > 0
            GradStats.shared(self.model).pre_clip = True
        # hf_stable's collators: we ask for the record ids and take them out again before the forward (the
        # collator that was asked is remembered: a key of the same name from any other collator is the user's)
        self._record_ids_collator = None
        if hasattr(self.data_collator, "return_record_ids"):
            self.data_collator.return_record_ids = True
            self._record_ids_collator = self.data_collator
        for cb in self.callback_handler.callbacks:  # their state goes into the TrainerState when we save, not per step
            if isinstance(cb, StabilityCallback):
                cb.writes_state_at_checkpoints = True

    def _write_callback_states(self) -> None:
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, StabilityCallback):
                cb._save_into(self.state)

    def _save_checkpoint(self, model, trial):
        self._write_callback_states()  # trainer_state.json carries every hf_stable callback's state of this step
        return super()._save_checkpoint(model, trial)

    def save_state(self):
        self._write_callback_states()
        return super().save_state()

    def _reads_gradients(self, model) -> bool:
        """Whether the step's norm comes from `GradStats`; decided on the run's first step and kept for the run (the
        launcher, the engine and the gradients' meshes do not change after setup; asking costs ~60 us a step)."""
        cached = getattr(self, "_reads_of", None)
        if cached is not None and cached[0] is model:
            return cached[1]
        from accelerate.utils import DistributedType
        from transformers.utils import is_sagemaker_mp_enabled

        if is_sagemaker_mp_enabled() or self.accelerator.distributed_type in (
            DistributedType.DEEPSPEED,
            DistributedType.XLA,
        ):
            reads = False  # DeepSpeed: the engine's own norm of the step it made
        else:
            reads = not has_mixed_mesh_grads(self, model)
        self._reads_of = (model, reads)
        return reads

    def _shared_norm(self, model, max_norm: float | None) -> torch.Tensor | None:
        """The step's global gradient norm from `GradStats` (clipping to `max_norm` after reading); None: fall back."""
        if not self._reads_gradients(model):
            return None
        if StepEngine.of(self.model).sharded:
            return self._sharded_norm(max_norm)
        self.accelerator.unscale_gradients()  # fp16: once per step, as the stock clip does
        stats = GradStats.shared(self.model)
        dev = stats.device_stats(self.model, step=self.state.global_step)
        with_grad = [p for p in self._every_param(model) if p.grad is not None]
        if dev is not None and len(dev.params) != len(with_grad):  # parameters (un)frozen since the groups were read
            stats.refresh()
            dev = stats.device_stats(self.model, step=self.state.global_step)
        if dev is None or len(dev.params) != len(with_grad):
            # no gradient at all, sharded tensors, or gradients outside the trainable set: torch's own answer over
            # every gradient, without a second unscale
            return torch.nn.utils.clip_grad_norm_(with_grad, max_norm if max_norm is not None else float("inf"))
        if max_norm is not None:
            norm = dev.global_norm
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in dev.params:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad)
            with stats.edited(self.state.global_step, coef, read=dev):  # our own clip: the statistics stay pre-clip
                for device, grads in by_device.items():
                    foreach_mul_(grads, coef.to(device))
        return dev.global_norm

    def _every_param(self, model) -> list:
        """`model`'s parameters, listed once per `train()` (walking the module tree costs ~2 ms a step on a small
        LoRA model; a step only asks which of them hold a gradient, so freezing and unfreezing are still seen)."""
        cached = getattr(self, "_params_of", None)
        if cached is None or cached[0] is not model:
            cached = self._params_of = (model, list(model.parameters()))
        return cached[1]

    def _sharded_norm(self, max_norm: float | None) -> torch.Tensor | None:
        """FSDP2: the norm over every rank's shards from the step's one gathered report (a collective every rank
        enters here, at the same point of every step); a clip scales the local shards by the agreed factor. Without
        a clip the norm is only logged: while the skip guard will read the step's statistics in
        `on_pre_optimizer_step`, the returned tensor is filled from that read (`core.step_readers`), so the step
        gathers once."""
        self.accelerator.unscale_gradients()
        stats = GradStats.shared(self.model)
        if max_norm is None:  # the norm is only logged (after the step): read it at the skip guard's gather
            norm = torch.full((), math.nan)
            step = self.state.global_step

            def read():
                report = stats.compute(self.model, step=step)
                norm.fill_(report.global_norm if report.available else 0.0)

            if stats.readers.defer(step, read):
                return norm
        report = stats.compute(self.model, step=self.state.global_step)
        if not report.available:
            return None
        norm = torch.tensor(report.global_norm)
        if max_norm is not None and math.isfinite(report.global_norm):
            coef = min(1.0, max_norm / (report.global_norm + 1e-6))
            dev = stats.device_stats(self.model, step=self.state.global_step)
            if coef < 1.0 and dev is not None:
                grads = [g for g in stats.engine.local_grads(dev.params) if g is not None]
                with stats.edited(self.state.global_step, torch.tensor(coef)):
                    foreach_mul_(grads, coef)
        return norm

    # --- DeepSpeed: the callbacks' pre-step between the engine's backward and its step ----------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        self._host_engine_step()
        return super().training_step(model, inputs, num_items_in_batch)

    def _host_engine_step(self) -> None:
        """Under DeepSpeed, make `accelerator.backward` run `on_pre_optimizer_step` before `engine.step()` (installed
        once, on the first micro-batch, when accelerate has built the engine)."""
        wrapper = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        if wrapper is None or getattr(wrapper, "_hf_stable_hosted", False):
            return
        adapter = StepEngine.of(self.model, refresh=True)
        if not isinstance(adapter, DeepSpeedEngine):
            return
        engine, handler = wrapper.engine, self.callback_handler
        trainer_pre_step = handler.on_pre_optimizer_step
        hosted = {"ran": False}

        def backward(loss, sync_gradients=True, **kwargs):
            engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
            engine.backward(loss, **kwargs)
            if sync_gradients:
                adapter.begin_step()
                self.control = trainer_pre_step(self.args, self.state, self.control)
                hosted["ran"] = True
                adapter.step(engine)

        def on_pre_optimizer_step(args, state, control):
            if hosted["ran"]:  # it ran inside backward, before the engine's step
                hosted["ran"] = False
                return control
            return trainer_pre_step(args, state, control)

        wrapper.backward = backward
        handler.on_pre_optimizer_step = on_pre_optimizer_step
        wrapper._hf_stable_hosted = adapter.hosted = True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ours = self._record_ids_collator is not None and self._record_ids_collator is self.data_collator
        record_ids = inputs.pop(RECORD_IDS_KEY, None) if ours and isinstance(inputs, dict) else None
        if record_ids is not None and self.model is not None:
            StepTap.shared(self.model).note_record_ids(record_ids)
        with self._training_forward(model, inputs, return_outputs):
            out = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        tap = StepTap.shared(self.model) if self.model is not None else None
        if tap is not None and tap.objective is not None:  # `hf_stable.stabilize`: the guards judge this loss
            tap.note_objective(out[0] if return_outputs else out, inputs, record_ids)
        return out

    def _training_forward(self, model, inputs, return_outputs: bool):
        """The chunked loss for a training step whose logits nobody reads; else the model's own forward."""
        chunked = (
            self.training_loss.chunked
            and not return_outputs
            and model.training
            and torch.is_grad_enabled()
            and self.compute_loss_func is None
            and self.label_smoother is None
            and isinstance(inputs, dict)
            and ("labels" in inputs or "shift_labels" in inputs)
        )
        tap = StepTap.shared(self.model) if self.model is not None else None
        if not chunked or (tap is not None and tap.reads_logits):
            return contextlib.nullcontext()
        return chunked_training_forward(model, self.training_loss, row_fns=tap.row_fns if tap is not None else ())

    def _clip_grad_norm(self, model):
        norm = self._shared_norm(model, self.args.max_grad_norm)
        return norm if norm is not None else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self._shared_norm(model, None)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # --- data plan for a changing gradient accumulation ----------------------------------------------------
    def _accumulation_control(self) -> AccumulationControl | None:
        acc = AccumulationControl.find(self.callback_handler.callbacks)
        return acc if acc is not None and acc.changes_accumulation(self.args) else None

    def _get_train_sampler(self, train_dataset=None):
        """The planned epoch stream when the accumulation changes (else the Trainer's sampler), minus quarantined
        records from the position they were named at (`callbacks.spike_forensics.wrap_train_sampler`)."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = self._planned_sampler(dataset)
        if sampler is None:
            sampler = super()._get_train_sampler(train_dataset)
        return wrap_train_sampler(self, sampler, dataset)

    def _planned_sampler(self, dataset) -> EpochStreamSampler | None:
        """The data's epochs back to back, enough for every micro-batch the accumulation plan can ask for (per rank:
        micro-batches x batch size; accelerate deals each rank its batches from the same stream)."""
        acc = self._accumulation_control()
        if acc is None or dataset is None or not has_length(dataset) or len(dataset) == 0:
            return None
        if self.args.train_sampling_strategy != "random" or self.args.gradient_accumulation_steps != 1:
            return None  # length-grouped or sequential order is the user's choice; the guard checks the capacity
        micro = acc.planned_micro_batches(0, self.args.max_steps)
        samples = micro * self._train_batch_size * max(1, self.args.world_size)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return EpochStreamSampler.covering(len(dataset), samples, seed)

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        epochs, skip = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        self._params_of = None  # a new run lists the model's parameters again (`_every_param`)
        self._reads_of = None  # and decides again whether the step's norm is read from `GradStats`
        acc = self._accumulation_control()
        if acc is None or resume_from_checkpoint is None or self.state.global_step == 0 or self.args.ignore_data_skip:
            return epochs, skip
        consumed = AccumulationControl.saved_micro_batches(self.state)
        if consumed is not None and self.args.gradient_accumulation_steps == 1:
            # the Trainer assumed global_step x 1 micro-batches; with accumulation 1 at train start an "update step"
            # of its plan is one micro-batch, so the real count maps onto (epoch, batches into it) directly
            epochs, skip = divmod(consumed, num_update_steps_per_epoch)
            acc.resume_exact()
        return epochs, skip
