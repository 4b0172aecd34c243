"""The recipe (`scripts/finetune.py`) with a fault injected from outside hf_stable, for `specificity.py --faults`.

    python benchmarks/specificity_faults.py nan|burst [recipe arguments ...]

* `nan`: the training forward's loss is NaN at optimizer steps 100, 200 and 300 (every forward of those steps);
* `burst`: one decoder layer's MLP output (layer 1) is multiplied by 1e3 at steps 150, 151 and 152.

A forward hook on the model, switched on for the fault steps by a `TrainerCallback` that the wrapped
`build_callbacks` appends; nothing in hf_stable knows about it. The guards must skip the NaN steps on every rank and
leave the run within 5 % of the clean one after the burst (issue 30).
"""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

FAULT_STEPS = {"nan": (100, 200, 300), "burst": (150, 151, 152)}


class FaultInjector(TrainerCallback):
    def __init__(self, kind: str):
        self.kind, self.active, self._handles = kind, False, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.kind == "nan":
            self._handles.append(model.register_forward_hook(self._nan_loss))
        else:
            mlp = next(m for name, m in model.named_modules() if name.endswith("layers.1.mlp"))
            self._handles.append(mlp.register_forward_hook(self._scale))

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 in FAULT_STEPS[self.kind]

    def on_step_end(self, args, state, control, **kwargs):
        self.active = False

    def _training(self, module) -> bool:
        return self.active and module.training and torch.is_grad_enabled()

    def _nan_loss(self, module, args, output):
        if self._training(module) and getattr(output, "loss", None) is not None:
            output.loss = output.loss * math.nan
        return output

    def _scale(self, module, args, output):
        return output * 1e3 if self._training(module) else output


def main() -> None:
    kind, argv = sys.argv[1], sys.argv[2:]
    from hf_stable import callbacks

    build = callbacks.build_callbacks

    def build_with_fault(*a, **kw):
        return [*build(*a, **kw), FaultInjector(kind)]

    callbacks.build_callbacks = build_with_fault
    script = Path.cwd() / "scripts" / "finetune.py"
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
