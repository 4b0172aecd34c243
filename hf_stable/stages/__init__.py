"""Training stages after SFT: `stage: dpo` / `stage: grpo` in the recipe (docs/post-training.md).

`stage: sft` (the default) is `scripts/finetune.py`'s own path, unchanged. A later stage is one module here with
`run(cfg, started) -> dict` (the run summary): TRL's trainer, built from `stage_arguments(cfg)`, under
`hf_stable.stabilize`, on the model `load_stage_model` returns (the SFT adapter continued, or a fresh adapter on a
merged export). TRL is imported only by the stage that runs.
"""

from __future__ import annotations

import importlib
import time

from hf_stable.config.stages import STAGES, require_trl

__all__ = ["STAGES", "STAGE_MODULES", "run_stage"]

# the module that runs each TRL stage: `run(cfg, started: float) -> dict`
STAGE_MODULES = {"dpo": "hf_stable.stages.dpo", "grpo": "hf_stable.stages.grpo"}


def run_stage(cfg, started: float | None = None) -> dict:
    """Run the stage `cfg.stage` names and return its run summary (run_summary.json).

    Raises:
        ValueError: `cfg.stage` is 'sft', which `scripts/finetune.py` runs itself.
        MissingDependencyError: the stage needs TRL and it is not installed (one line naming the extra).
    """
    if cfg.stage not in STAGE_MODULES:
        raise ValueError(f"stage {cfg.stage!r}: the SFT stage is scripts/finetune.py's own path (stages: {STAGES})")
    require_trl(cfg.stage)
    module = importlib.import_module(STAGE_MODULES[cfg.stage])
    return module.run(cfg, time.time() if started is None else started)
