"""What the doctor's dry run changes on the model, saved before it and put back exactly after it: the trainable
weights, the gradients, train/eval mode, gradient checkpointing and the CPU and CUDA RNG states."""

from __future__ import annotations

import torch

from hf_stable.optim.roles import named_parameters_once


def is_checkpointing(model) -> bool:
    """transformers 5 renamed gradient checkpointing to activation checkpointing; read whichever exists."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        try:
            return bool(getattr(model, name))
        except AttributeError:
            continue
    return False


def _call(model, *names: str) -> None:
    for name in names:
        if hasattr(model, name):
            getattr(model, name)()
            return


class RestorePoint:
    """Everything the dry run changes, saved to be put back exactly."""

    def __init__(self, model):
        self.model = model
        self.params = [(p, p.detach().to("cpu", copy=True)) for _, p in named_parameters_once(model)]
        self.grads = {id(p): p.grad for p in model.parameters()}
        self.training = model.training
        self.checkpointing = is_checkpointing(model)
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in self.params:
                p.copy_(saved.to(p.device))
        for p in self.model.parameters():
            p.grad = self.grads.get(id(p))
        if not self.checkpointing and is_checkpointing(self.model):
            _call(self.model, "activation_checkpointing_disable", "gradient_checkpointing_disable")
        self.model.train(self.training)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
