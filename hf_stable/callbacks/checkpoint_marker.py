"""`CheckpointMarker`: writes the completion marker into each checkpoint once every rank has finished writing it
(what the marker holds and why: `hf_stable/checkpoints.py`)."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from hf_stable.checkpoints import mark_complete
from hf_stable.distributed import barrier, is_distributed, world_size


class CheckpointMarker(TrainerCallback):
    """Marks each checkpoint complete once every rank has finished writing it.

    Add it after every other callback that writes into checkpoints in `on_save`, so the marker comes last.
    With DDP/DeepSpeed every rank must run it (the barrier is a collective), which the Trainer guarantees:
    `on_save` is called on all ranks at the same steps.

    Example:
        >>> trainer = Trainer(..., callbacks=[*monitors, CheckpointMarker()])
        >>> latest_complete_checkpoint(args.output_dir)
    """

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        barrier()  # rank 1 may still be writing its RNG state or ZeRO shard
        failed = None
        try:  # args.should_save: the process that writes shared files (one per node with save_on_each_node)
            if args.should_save and folder.is_dir():
                mark_complete(folder, state.global_step, world_size() if is_distributed() else 1)
        except Exception as e:  # noqa: BLE001 - raised below, once the other ranks are released from the barrier
            failed = e
        barrier()  # nobody reads or rotates checkpoints before the marker exists
        if failed is not None:
            raise failed
