"""One training step's loss and full gradients under one sharded engine (DeepSpeed ZeRO-2 / ZeRO-3 or FSDP2, 2 gloo
ranks), once with the chunked training loss and once with the model's full-logits forward, from the same weights
and the same batches.

Launched by tests/test_chunked_loss_engines.py as `torchrun --nproc_per_node 2 chunked_loss_run.py ENGINE OUT`. Two
`StableTrainer`s of one step each (``training_loss.chunked`` false, then true) on two copies of a tiny Llama built
from the same seed, with LoRA on the attention / MLP projections and on lm_head (under ZeRO-2 its trainable factors
take the chunked path's own gradient route, returned by its autograd function; under ZeRO-3 and FSDP2 each chunk runs
by plain autograd under torch.utils.checkpoint, the head module called again in the backward). Padded rows of different lengths with masked prompts; a different batch
on each rank. ZeRO-3 partitions every parameter (persistence threshold 0; by default a tiny model's weights would all
stay whole), so the LM head's weight is gathered by the engine around each head call, in the forward and again in
the chunked backward: the ranks must call it equally often.

Each rank writes OUT/rank<i>.pt: per path its step loss, every trainable gradient in full (gathered from the
engine's partitions or shards between backward and the optimizer step) and what the LM head saw (its input's rank:
2 for the chunked rows, 3 for the model's ``[B, T, H]``; the numel of its weight inside the call and outside it).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
from pathlib import Path

import fsdp_cpu
import torch
from engines import engine_args
from guards_common import TARGETS, VOCAB, tiny_lora_llama, training_args
from transformers import TrainerCallback

from hf_stable.config.loss import TrainingLossConfig
from hf_stable.core.engine import StepEngine
from hf_stable.distributed import shutdown
from hf_stable.trainer import StableTrainer


def lora_model(on_head: bool):
    from peft import LoraConfig, get_peft_model

    model = tiny_lora_llama(lora=False)
    torch.manual_seed(1)
    targets = [*TARGETS, "lm_head"] if on_head else TARGETS
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def padded_rows(length: int = 24, seed: int = 2) -> list[dict]:
    """Four right-padded rows with masked prompts, supervising 20, 12, 3 and 1 tokens: however the sampler pairs
    them, the two ranks' batches need different numbers of 5-row chunks."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for prompt, valid in [(2, 22), (4, 16), (5, 8), (3, 4)]:
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        mask = (torch.arange(length) < valid).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[:prompt] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def full_grads(model) -> list[torch.Tensor]:
    """Every trainable gradient in full, between the engine's backward and its step (collectives on every rank)."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = StepEngine.of(model).name
    if name.startswith("deepspeed"):
        from deepspeed.utils import safe_get_full_grad

        return [safe_get_full_grad(p).detach().clone().float() for p in params]
    if name == "fsdp2":
        return [p.grad.full_tensor().detach().clone() for p in params]
    return [p.grad.detach().clone() for p in params]


class Capture(TrainerCallback):
    """The step's full gradients, read in `on_pre_optimizer_step` (hosted before the engine's step under
    DeepSpeed); the head's input ranks and weight sizes from a forward hook."""

    def __init__(self, model):
        self.model, self.grads, self.head_calls = model, None, []
        head = model.get_base_model().lm_head
        base = getattr(head, "base_layer", head)  # under the LoRA wrapper: ZeRO-3 gathers around this module's call
        base.register_forward_hook(lambda m, a, o: self.head_calls.append((a[0].dim(), m.weight.numel())))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = full_grads(self.model)


class LossTrainer(StableTrainer):
    checkpointed = None  # the chunked path's mode (None: the model's forward)

    @contextlib.contextmanager
    def _training_forward(self, model, inputs, return_outputs):
        with super()._training_forward(model, inputs, return_outputs) as run:
            self.checkpointed = None if run is None else run.checkpointed
            yield run

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.supervised = int(inputs["labels"][:, 1:].ne(-100).sum())  # this rank's batch (the shifted labels)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_loss = loss.detach().float().cpu()
        return loss


def main(engine: str, out: str) -> None:
    faulthandler.dump_traceback_later(int(os.environ.get("ENGINES_TIMEOUT", "200")), exit=True)
    if engine == "fsdp2":
        fsdp_cpu.enable()
    Path(out).mkdir(parents=True, exist_ok=True)
    # LoRA on lm_head too (under ZeRO-3 and FSDP2 its chunks run checkpointed); before TrainingArguments (ZeRO-3's
    # zero.Init)
    models = [lora_model(on_head=True) for _ in range(2)]
    kw = engine_args(engine)
    if engine == "zero3":
        kw["deepspeed"]["zero_optimization"].update(
            stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0
        )
    result = {}
    for chunked, model in zip((False, True), models, strict=True):
        args = training_args(Path(out) / f"c{int(chunked)}", max_steps=1, per_device_train_batch_size=2, **kw)
        capture = Capture(model)
        trainer = LossTrainer(
            model=model,
            args=args,
            train_dataset=padded_rows(),
            callbacks=[capture],
            training_loss=TrainingLossConfig(chunked=chunked, chunk_size=5),
        )
        trainer.train()
        weight = model.get_base_model().get_output_embeddings().weight
        result[chunked] = {
            "loss": trainer.step_loss,
            "grads": [g.cpu() for g in capture.grads],
            "names": [n for n, p in model.named_parameters() if p.requires_grad],
            "head_calls": capture.head_calls,
            "supervised": trainer.supervised,
            "head_weight_numel_outside": weight.numel(),
            "engine": StepEngine.of(model).name,
            "checkpointed": trainer.checkpointed,
        }
    result["world_size"] = args.world_size
    torch.save(result, Path(out, f"rank{args.process_index}.pt"))
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
