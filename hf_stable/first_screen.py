"""The first screen of a recipe run holds hf_stable's lines: other libraries' notices that are wrong for this run go.

Measured on the README's launch (`accelerate launch scripts/finetune.py --training.max_steps 20`, CPU, the default
install with DeepSpeed): 12 of 41 lines came from other libraries, each true in general and wrong here. Each is
removed where it starts, and only under the condition that makes it wrong; the same notice in any other situation
still shows:

* DeepSpeed's `[WARNING] Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
  it`: accelerate imports DeepSpeed when the Trainer is built, whenever it is installed, also on runs that do not use
  it. Where DeepSpeed's own detection would end on the CPU (no torch accelerator, none of the device packages it
  probes), `DS_ACCELERATOR=cpu` says so beforehand: the same choice, without the warning.
* peft's read of transformers' deprecated `is_gradient_checkpointing` (a FutureWarning from `PeftModel.__init__`,
  peft 0.21 with transformers 5): not ours to change, and nothing the user can act on.
* torch's `'pin_memory' argument is set as true but no accelerator is found` (UserWarning, every DataLoader the
  Trainer builds): only where there is no accelerator, where pinning is a no-op.
* transformers' "Loading weights" progress bar for the embedded base (a second at most); a Hub or local
  checkpoint keeps it: loading 8B weights takes minutes and the bar says how far it is.

accelerate's block of launch defaults is the launcher's (`hf_stable.launcher`), before any of this runs.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

# the device packages DeepSpeed 0.18's accelerator detection imports, in its order, before it falls back to the CPU
_DEEPSPEED_DEVICE_PACKAGES = ("torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir")
PEFT_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"
PIN_MEMORY = r"'pin_memory' argument is set as true but no accelerator is found"


def has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def deepspeed_would_pick_cpu() -> bool:
    """True where DeepSpeed's own detection ends on the CPU: no torch accelerator (CUDA, XPU, MPS, ...) and none of the
    device packages it tries."""
    if has_accelerator():
        return False
    for name in _DEEPSPEED_DEVICE_PACKAGES:
        try:
            if importlib.util.find_spec(name) is not None:
                return False
        except (ImportError, ValueError):
            continue
    return True


def quiet_first_screen(cfg, env=None) -> list[str]:
    """Remove the notices above for this process (call before the model is loaded and the Trainer built; each
    rank calls it). Returns what it did, for tests."""
    env = os.environ if env is None else env
    done = []
    if "DS_ACCELERATOR" not in env and deepspeed_would_pick_cpu():
        env["DS_ACCELERATOR"] = "cpu"
        done.append("DS_ACCELERATOR=cpu")
    # attributed to transformers (the property warns with stacklevel 1), raised from peft's PeftModel.__init__
    warnings.filterwarnings("ignore", message=PEFT_DEPRECATION, category=FutureWarning, module="transformers")
    done.append("peft is_gradient_checkpointing")
    if not has_accelerator():
        warnings.filterwarnings("ignore", message=PIN_MEMORY, category=UserWarning, module="torch")
        done.append("pin_memory")
    if cfg.model.is_embedded:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        done.append("loading bar")
    return done
