"""The engines the sharded-training tests and benchmarks run on 2 gloo ranks: the TrainingArguments of each, and the
full trainable weights gathered from the ranks' parts. Free of pytest (torchrun workers and benchmarks import it)."""

from __future__ import annotations

import torch

from hf_stable.core.engine import StepEngine

ENGINES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


def no_shm_kernel() -> None:
    """DeepSpeed on CPU JIT-compiles a shared-memory all-reduce kernel when its backend starts (about 80 s of g++ on
    2 cores the first time, cached in ~/.cache/torch_extensions behind a lock file). Two test workers starting
    DeepSpeed at once wait on one build, and a run killed at its timeout mid-build leaves the lock behind: every later
    DeepSpeed run then waits on it for ever. The test ranks use plain gloo collectives instead. The module is looked
    up in sys.modules: as an attribute, `deepspeed.comm.torch` is the torch package (deepspeed.comm imports torch)."""
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def deepspeed_config(stage: int) -> dict:
    """The ZeRO `stage` config of the tests (the shared-memory kernel off: `no_shm_kernel`)."""
    no_shm_kernel()
    return {
        "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": "auto",
        "gradient_accumulation_steps": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "steps_per_print": 10**9,
    }


def engine_args(engine: str) -> dict:
    if engine.startswith("zero"):
        return {"deepspeed": deepspeed_config(int(engine[-1]))}
    if engine == "fsdp2":
        return {
            "fsdp": "full_shard",
            "fsdp_config": {
                "fsdp_version": 2,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
                "state_dict_type": "FULL_STATE_DICT",
            },
        }
    return {}


def full_weights(model) -> list[torch.Tensor]:
    """Every trainable weight in full (gathered from the ranks' parts under ZeRO-3 and FSDP2)."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = StepEngine.of(model).name
    if name == "fsdp2":
        return [p.full_tensor().detach().clone() for p in params]
    if name == "deepspeed_zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]
