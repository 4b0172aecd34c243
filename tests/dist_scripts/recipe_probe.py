"""Test launcher: runs scripts/finetune.py unchanged, plus a probe callback and optional fault injection.

    torchrun --nproc_per_node 2 tests/dist_scripts/recipe_probe.py <finetune.py arguments>

Environment:
    HF_STABLE_PROBE_DIR   where each rank writes probe_rank<r>.json (dataset row indices of its batches, events
                          and states of the hf_stable callbacks), lora_rank<r>.pt (its final LoRA tensors,
                          gathered under ZeRO-3) and exit_rank<r>.json (its exit status), and rank 0 writes
                          logits.pt (the in-memory model's logits on fixed ids).
    HF_STABLE_FAULT       "kill_in_save:N"     SIGKILL (kill -9) while checkpoint-N is being written: after the
                                               adapter, before optimizer / RNG / trainer_state / marker;
                          "sigterm:N"          the process sends itself SIGTERM at the end of step N;
                          "sigterm:N:R"        only rank R does (the other ranks must follow via the all-reduce);
                          "sigterm_at_init"    the process sends itself SIGTERM as the Trainer is built (before
                                               training starts);
                          "pause:N"            at the end of step N every rank writes paused_rank<r> into the
                                               probe dir and waits (up to 120 s) until a signal reached its
                                               PreemptionCallback: the test signals the launcher meanwhile, so
                                               the run stops after step N + 1;
                          "perturb:N:R"        rank R alone adds 1e-3 to one element of its first LoRA weight at
                                               the end of step N (its replica of the weights then differs);
                          "enospc:N"           the disk fills up when checkpoint-N starts to be written: from
                                               then on every new write under training.output_dir fails with
                                               ENOSPC (a file is created, then its first write fails; only an
                                               in-place overwrite of an existing file still works, as on a
                                               real full disk); "enospc:final" does so at the final save;
                                               "enospc:N:R": only rank R's writes fail (also its torch.save
                                               of rng_state_R.pth).

The recipe is run through `runpy`, so what runs is exactly scripts/finetune.py; the probe only adds an index
column to the train dataset (stripped again by a wrapper around the data collator, to see which rows each rank
gets) and one callback. Training is unchanged: the same rows reach the recipe's collator in the same order.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch
import transformers
from harness import PROBE_INPUT_IDS
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[2]
PROBE_DIR = os.environ.get("HF_STABLE_PROBE_DIR")
FAULT = os.environ.get("HF_STABLE_FAULT", "")
PROBE_IDS = torch.tensor(PROBE_INPUT_IDS)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


INDEX_COLUMN = "_probe_index"


class RecordingCollator:
    """Notes which dataset rows each rank's batches hold (by an index column it strips before collating)."""

    def __init__(self, inner, probe):
        self.inner, self.probe = inner, probe

    def __call__(self, features):
        indices = [f.pop(INDEX_COLUMN, None) for f in features]  # eval batches have no index
        if self.probe.recording:
            self.probe.samples.append(indices)
        return self.inner(features)


def _lora_tensors(model) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    if named and hasattr(named[0][1], "ds_id"):  # ZeRO-3: every rank holds a shard; gather (a collective)
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}
    if named and isinstance(named[0][1], DTensor):  # FSDP2: each rank holds a dim-0 shard; gather (a collective)
        return {n: p.detach().full_tensor().clone() for n, p in named}
    return {n: p.detach().clone() for n, p in named}


class Probe(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer
        self.gradient_checkpointing = False
        self.output_dtypes: list[str] = []
        self._hook = None
        self.recording = False
        self.samples: list[list[int]] = []
        self.steps: list[int] = []
        self.optimizer_groups: list[dict] | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from hf_stable.optim import group_table

        self.recording = True
        self.optimizer_groups = group_table(optimizer) if optimizer is not None else None  # as the Trainer built it
        self.gradient_checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
        self.output_dtypes: list[str] = []
        head = model.get_output_embeddings()
        self._hook = head.register_forward_hook(lambda mod, inp, out: self.output_dtypes.append(str(out.dtype)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append(state.global_step)
        if FAULT.startswith("perturb:"):
            _, step, rank = FAULT.split(":")
            if state.global_step == int(step) and _rank() == int(rank):
                name, weight = next((n, p) for n, p in model.named_parameters() if "lora_A" in n)
                with torch.no_grad():
                    weight.view(-1)[0] += 1e-3
                print(f"probe: rank {rank} perturbed {name} at step {step}", file=sys.stderr, flush=True)
        if FAULT.startswith("sigterm:"):
            parts = FAULT.split(":")
            if state.global_step == int(parts[1]) and (len(parts) < 3 or _rank() == int(parts[2])):
                os.kill(os.getpid(), signal.SIGTERM)
        if FAULT.startswith("pause:") and state.global_step == int(FAULT.split(":")[1]):
            self._pause()

    def _pause(self) -> None:
        from hf_stable.callbacks.preemption_callback import find_preemption

        preemption = find_preemption(self.trainer)
        Path(PROBE_DIR).mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: the test reads the pid as soon as the name appears
        tmp = Path(PROBE_DIR) / f".paused_rank{_rank()}.tmp"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, Path(PROBE_DIR) / f"paused_rank{_rank()}")
        deadline = time.monotonic() + 120
        while not preemption.pending and time.monotonic() < deadline:
            time.sleep(0.05)

    def _zero_stage(self) -> int | None:
        plugin = getattr(self.trainer.accelerator.state, "deepspeed_plugin", None)
        return plugin.zero_stage if plugin is not None else None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.recording = False
        if self._hook is not None:
            self._hook.remove()
        if not PROBE_DIR:
            return
        out = Path(PROBE_DIR)
        out.mkdir(parents=True, exist_ok=True)
        rank = _rank()
        torch.save(_lora_tensors(model), out / f"lora_rank{rank}.pt")
        was_training = model.training
        model.eval()
        with torch.no_grad():  # every rank runs it: under ZeRO-3 the forward gathers shards collectively
            logits = model(input_ids=PROBE_IDS.to(args.device)).logits.float().cpu()
        model.train(was_training)
        if rank == 0:
            torch.save(logits, out / "logits.pt")
        from hf_stable.callbacks.base import StabilityCallback

        ours = [cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, StabilityCallback)]
        record = {
            "rank": rank,
            "world_size": args.world_size,
            "should_save": args.should_save,
            "global_step": state.global_step,
            "steps": self.steps,
            "gradient_checkpointing": self.gradient_checkpointing,
            "deepspeed_stage": self._zero_stage(),
            "params_partitioned": any(hasattr(p, "ds_id") for p in model.parameters()),
            "params_dtensor": any(isinstance(p, DTensor) for p in model.parameters()),  # FSDP2 really sharded
            "distributed_type": str(self.trainer.accelerator.distributed_type),
            "optimizer_groups": self.optimizer_groups,
            "train_output_dtypes": sorted(set(self.output_dtypes)),
            "samples": self.samples,
            "dataset_size": len(self.trainer.train_dataset),
            "callbacks": {
                cb.state_key: {
                    "state": cb.state_dict(),
                    "events": [{k: v for k, v in e.items() if k != "time"} for e in cb.events],
                }
                for cb in ours
            },
            "log_history": state.log_history,
        }
        (out / f"probe_rank{rank}.json").write_text(json.dumps(record, default=str))


_original_init = transformers.Trainer.__init__


def _probed_init(self, *args, **kwargs):
    if FAULT == "sigterm_at_init":
        os.kill(os.getpid(), signal.SIGTERM)
    _original_init(self, *args, **kwargs)
    probe = Probe(self)
    if self.train_dataset is not None:
        self.train_dataset = self.train_dataset.add_column(INDEX_COLUMN, list(range(len(self.train_dataset))))
    self.data_collator = RecordingCollator(self.data_collator, probe)
    self.add_callback(probe)


transformers.Trainer.__init__ = _probed_init

if FAULT.startswith("kill_in_save:"):
    _kill_step = int(FAULT.split(":")[1])
    _original_save_opt = transformers.Trainer._save_optimizer_and_scheduler

    def _save_opt_then_die(self, output_dir):
        if self.state.global_step == _kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return _original_save_opt(self, output_dir)

    transformers.Trainer._save_optimizer_and_scheduler = _save_opt_then_die


if FAULT.startswith("enospc:"):
    import builtins
    import errno
    import io

    import safetensors.torch

    _when = FAULT.split(":")[1]
    _rank_filled = FAULT.split(":")[2] if FAULT.count(":") > 1 else None
    _full = {"on": False}
    _out = Path(sys.argv[sys.argv.index("--training.output_dir") + 1]).resolve()

    def _filling(path) -> bool:
        if _rank_filled is not None and str(_rank()) != _rank_filled:
            return False
        try:
            return _full["on"] and Path(path).resolve().is_relative_to(_out)
        except (TypeError, ValueError, OSError):
            return False

    def _no_space(path):
        return OSError(errno.ENOSPC, "No space left on device", str(path))

    def _full_open(opener):
        def open_(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax") and not isinstance(file, int) and _filling(file):
                opener(file, mode, *args, **kwargs).close()  # creating the file works; writing its data does not
                raise _no_space(file)
            return opener(file, mode, *args, **kwargs)

        return open_

    builtins.open = io.open = _full_open(builtins.open)
    _save_file = safetensors.torch.save_file

    def _full_save_file(tensors, filename, *args, **kwargs):
        if _filling(filename):  # what the Rust writer raises on a full disk
            Path(filename).touch()
            raise safetensors.SafetensorError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                'device" })'
            )
        return _save_file(tensors, filename, *args, **kwargs)

    safetensors.torch.save_file = _full_save_file
    _torch_save = torch.save

    def _full_torch_save(obj, f, *args, **kwargs):
        if _rank_filled is not None and isinstance(f, (str, os.PathLike)) and _filling(f):
            Path(f).touch()  # torch writes through its own C++ file writer, not Python's open
            raise _no_space(f)
        return _torch_save(obj, f, *args, **kwargs)

    torch.save = _full_torch_save
    _save_checkpoint, _save_model = transformers.Trainer._save_checkpoint, transformers.Trainer.save_model

    def _checkpoint_fills_disk(self, *args, **kwargs):
        _full["on"] = _full["on"] or str(self.state.global_step) == _when
        return _save_checkpoint(self, *args, **kwargs)

    def _final_save_fills_disk(self, output_dir=None, _internal_call=False):
        _full["on"] = _full["on"] or (_when == "final" and not _internal_call)
        return _save_model(self, output_dir, _internal_call)

    transformers.Trainer._save_checkpoint = _checkpoint_fills_disk
    transformers.Trainer.save_model = _final_save_fills_disk


if any("deepspeed" in a for a in sys.argv[1:]) or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
    from engines import no_shm_kernel  # the ranks use plain gloo collectives (see engines.py)

    no_shm_kernel()


if "--training.fsdp" in sys.argv[1:] or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
    import fsdp_cpu  # test only: accelerate runs FSDP2 on CPU ranks (see fsdp_cpu.py)

    fsdp_cpu.enable()


if __name__ == "__main__":
    script = ROOT / "scripts" / "finetune.py"
    sys.argv = [str(script), *sys.argv[1:]]
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except BaseException:
        code = 1
        raise
    finally:
        if PROBE_DIR:  # each rank's own exit status (torchrun only reports a summary)
            Path(PROBE_DIR).mkdir(parents=True, exist_ok=True)
            (Path(PROBE_DIR) / f"exit_rank{_rank()}.json").write_text(json.dumps({"rank": _rank(), "code": code}))
