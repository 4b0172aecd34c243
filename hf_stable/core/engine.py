"""`StepEngine`: where this step's gradients live, and how a step is skipped or undone - one class per engine.

Monitors and guards never test the engine themselves; they ask the step engine of the model (`StepEngine.of`):

| engine | gradients | a skip | a rollback snapshot |
|---|---|---|---|
| plain / DDP (`StepEngine`) | `p.grad`, the same on every rank | `p.grad = None` | the optimizer's parameters and state |
| FSDP2 (`FSDP2Engine`) | `p.grad.to_local()`: this rank's `Shard(0)` rows | `p.grad = None` on every rank | this rank's shards of them |
| DeepSpeed ZeRO-1/2 (`DeepSpeedEngine`) | this rank's fragment of each gradient in ZeRO's partitions (`_hp_mapping`) | the engine's own non-finite skip, forced on every rank | ZeRO's fp32 partitions and their state, and the model's weights |
| DeepSpeed ZeRO-3 (`DeepSpeedEngine`) | this rank's gradient partition (`safe_get_local_grad`) | as ZeRO-1/2 | the fp32 and the weights' partitions, and the state |

`replicated_weights` says whether every rank holds the whole model weights (plain/DDP, ZeRO-1/2) or its own part
of them (FSDP2, ZeRO-3): only replicas can be compared across ranks (`ReplicaCheck`).

With `sharded` engines every parameter has a local gradient on every rank (an empty tensor where a rank holds none
of it), so per-tensor vectors line up across ranks and statistics combine by summing squares over ranks
(`GradStats`). DeepSpeed steps inside `accelerator.backward`; `StableTrainer` runs the callbacks'
`on_pre_optimizer_step` between the engine's backward and its step, and `DeepSpeedEngine.step` then skips as decided
and keeps the LR schedule on `global_step` when the engine skipped (its own overflow skip holds the schedule back).

FSDP1 (`FullyShardedDataParallel`: flat parameters, a rank's `.grad` its own flat shard as a plain tensor) is refused
before the first step (`refuse_fsdp1`): its shards look like DDP's whole gradients, so every rank would judge, clip
and skip on its own numbers. What asked for it (the `TrainingArguments`, a launch config's environment, accelerate's
plugin, an FSDP1-wrapped model) is named with the line that selects FSDP2.

Private DeepSpeed attributes are read through `hf_stable.compat`.
"""

from __future__ import annotations

import torch

from hf_stable import compat
from hf_stable.core.model_table import ModelTable

_ENGINES = ModelTable()


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


class StepEngine:
    """Plain and DDP training: every rank holds every gradient (after DDP's all-reduce, the same on each)."""

    name = "ddp"
    sharded = False  # True: a rank holds part of each gradient; statistics sum squares over ranks
    owns_step = False  # True: the engine steps inside backward (DeepSpeed); `StableTrainer` hosts the callbacks
    can_rerun = True  # the non-finite locator may re-run a step's micro-batches for fresh gradients
    whole_rows = True  # a local gradient holds whole rows of its parameter (row-wise clipping, AGC)
    forward_is_collective = False  # a forward all-gathers weights: every rank must run the same forwards
    replicated_weights = True  # every rank holds the whole model weights (they must agree: `ReplicaCheck`)
    # a trainable parameter can be an autograd function's input outside its module's forward (ZeRO-3: there it is an
    # empty partition, its gradient would not match it; FSDP2: the sharded DTensor, not the unsharded parameter the
    # module computes with, so it would get no gradient)
    params_outside_forward = True

    def __init__(self, model=None):
        self.skip_requested = False
        self.last_applied = True  # DeepSpeed: whether the engine's last step updated the weights
        self.hosted = False  # DeepSpeed: `StableTrainer` runs the callbacks' pre-step before the engine's step
        self.unhosted_said = False

    @staticmethod
    def of(model, refresh: bool = False) -> StepEngine:
        """The step engine of `model` (detected from its trainable parameters, then cached).

        Raises:
            ConfigError: the model is trained with FSDP1 (see `refuse_fsdp1`).
        """
        engine = _ENGINES.get(model)
        if engine is None or refresh:
            found = _detect(model)
            if engine is None or found.name != engine.name:  # the same engine keeps its state (hosted, said)
                engine = _ENGINES[model] = found
        return engine

    def describe(self) -> str:
        return self.name

    # --- gradients ---------------------------------------------------------------------------------------------------
    def local_grads(self, params: list) -> list[torch.Tensor | None]:
        """This rank's gradient of each parameter (None: no gradient this step, e.g. dropped by a skip)."""
        return [p.grad for p in params]

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter or optimizer-state tensor (the tensor itself when unsharded)."""
        return tensor.detach()

    def local_no_grad(self, tensor: torch.Tensor) -> torch.Tensor:
        """`local` for a reader inside `torch.no_grad()`: an unsharded tensor is read as it is, without the `detach`
        (an op per tensor, hundreds for a snapshot); an engine with its own `local` answers with that."""
        return tensor if type(self).local is StepEngine.local else self.local(tensor)

    def drop_gradients(self, params: list) -> int:
        """Skip the step: no gradient is applied, no optimizer moment or weight decay moves. Returns how many
        gradients were dropped."""
        n = 0
        for p in params:
            if p.grad is not None:
                p.grad = None
                n += 1
        return n

    # --- rollback ----------------------------------------------------------------------------------------------------
    def extra_snapshot_tensors(self, model) -> list[torch.Tensor]:
        """Live tensors a rollback must restore besides the optimizer's parameters and state (the model's own weights
        when the optimizer updates a separate master copy)."""
        return []

    def begin_step(self) -> None:
        self.skip_requested = False


class FSDP2Engine(StepEngine):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state are `DTensor`s sharded on dim 0."""

    name = "fsdp2"
    sharded = True
    can_rerun = False  # a backward outside the Trainer's step would run FSDP's reduce-scatters
    forward_is_collective = True
    replicated_weights = False  # a rank holds its own Shard(0) rows: nothing to compare across ranks
    params_outside_forward = False

    def local_grads(self, params: list) -> list[torch.Tensor | None]:
        with torch.no_grad():  # `to_local` without grad is the local shard itself, not an autograd call per tensor
            return [None if p.grad is None else (p.grad.to_local() if _is_dtensor(p.grad) else p.grad) for p in params]

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.detach()
        return t.to_local() if _is_dtensor(t) else t


class DeepSpeedEngine(StepEngine):
    """DeepSpeed ZeRO-1/2/3: gradients live in ZeRO's partitions between `engine.backward` and `engine.step`."""

    sharded = True
    owns_step = True
    can_rerun = False
    whole_rows = False  # ZeRO flattens parameters into partitions: a fragment is a flat slice

    def __init__(self, model=None, stage: int = 2):
        super().__init__(model)
        self.stage = stage
        self.name = f"deepspeed_zero{stage}"
        self.forward_is_collective = stage == 3
        # ZeRO-1/2 partition the optimizer's fp32 copy and state; the model's weights stay whole on every rank
        self.replicated_weights = stage < 3
        self.params_outside_forward = stage < 3
        self._empty: dict[int, torch.Tensor] = {}  # one empty tensor per parameter without a local fragment
        # This step's fragments per parameter list, kept from `begin_step` (called by `StableTrainer` right after
        # the boundary backward, when ZeRO has filled its gradient partitions) to `step` (which frees them): ZeRO
        # does not replace a partition in between, so each lookup (`_hp_mapping` per parameter, in Python) is made
        # once a step instead of at every read. Never kept outside that window (an unhosted run never opens it).
        self._fragments: dict[int, tuple[tuple[int, ...], list]] | None = None

    def begin_step(self) -> None:
        super().begin_step()
        self._fragments = {}

    def local_grads(self, params: list) -> list[torch.Tensor | None]:
        if self.skip_requested:
            return [None] * len(params)
        cache = self._fragments
        if cache is not None:
            key = tuple(map(id, params))
            hit = cache.get(id(params))
            if hit is not None and hit[0] == key:
                return list(hit[1])
            out = self._lookup(params)
            cache[id(params)] = (key, out)
            return list(out)
        return self._lookup(params)

    def _lookup(self, params: list) -> list[torch.Tensor | None]:
        out = []
        for p in params:
            g = compat.deepspeed_local_grad(p)
            if g is None:
                if not p.requires_grad:
                    out.append(None)
                    continue
                g = self._empty.get(id(p))
                if g is None:
                    g = self._empty[id(p)] = torch.zeros(0, dtype=torch.float32, device=compat.deepspeed_device(p))
            out.append(g)
        return out

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        t = compat.deepspeed_local_param(tensor) if self.stage == 3 else None
        return (t if t is not None else tensor).detach()

    def drop_gradients(self, params: list) -> int:
        """Mark the step skipped; `step()` makes the engine skip it (its own non-finite skip, on every rank)."""
        self.skip_requested = True
        return len(params)

    def extra_snapshot_tensors(self, model) -> list[torch.Tensor]:
        # ZeRO's optimizer updates fp32 partitions; the model's (low-precision) weights are a copy the engine
        # refreshes after each applied step, so a restore puts them back too: the full weights under ZeRO-1/2, this
        # rank's partition under ZeRO-3 (whose step re-partitions every parameter, persistent ones too, and the
        # next forward gathers them again from the partitions - a restore is always followed by a skipped step).
        return [self.local(p) for p in model.parameters() if p.requires_grad]

    def step(self, engine) -> bool:
        """Run the engine's step as decided by the callbacks; returns whether an update was applied.

        A skip writes NaN into one local gradient on every rank, so ZeRO's overflow check (all-reduced over the
        data-parallel group) discards the step everywhere: no optimizer step, no moment or weight-decay update,
        gradients cleared, the engine's counters advance. Its fp16 loss scale is put back (our skip is not an
        overflow). When the engine did not apply the step (ours, or its own overflow), the LR schedule still
        advances, so it stays on `global_step` as in a run without DeepSpeed: the engine's own scheduler is stepped
        here, or the optimizer's overflow flag is cleared so the Trainer steps its scheduler (it skips that
        when accelerate reports the step skipped).
        """
        forced = self.skip_requested
        scaler = compat.deepspeed_loss_scaler_state(engine) if forced else None
        self._fragments = None  # the step frees the partitions the fragments view
        if forced:
            self.skip_requested = False  # read the real fragments to poison one
            grads = [g for g in self.local_grads(_trainable(engine)) if g is not None and g.numel()]
            if grads:
                grads[0].view(-1)[0] = float("nan")
        engine.step()
        applied = self.last_applied = engine.was_step_applied()
        if scaler is not None:
            compat.restore_deepspeed_loss_scaler_state(engine, scaler)
        if not applied:
            if engine.lr_scheduler is not None:  # the engine steps the schedule (a DeepSpeed "scheduler" config)
                engine.lr_scheduler.step()
            else:  # the Trainer steps it unless the optimizer reports the step skipped (accelerate reads overflow)
                compat.deepspeed_clear_overflow(engine)
        return applied


def _trainable(engine) -> list:
    return [p for p in engine.module.parameters() if p.requires_grad]


def _detect(model) -> StepEngine:
    refuse_fsdp1(model=model)
    params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
    for p in params:
        if hasattr(p, "ds_id"):
            return DeepSpeedEngine(model, stage=3)
        if hasattr(p, "_hp_mapping"):
            return DeepSpeedEngine(model, stage=compat.deepspeed_stage())
    if any(_is_dtensor(p) for p in params):
        return FSDP2Engine(model)
    return StepEngine(model)


# --- FSDP1: refused ----------------------------------------------------------------------------------------------
_FSDP1_WHY = (
    "FSDP1 (fsdp_version 1) is not supported by hf_stable: every rank holds a flat shard of each gradient that looks "
    "like a whole one, so the monitors and guards would judge, clip and skip on this rank's shard alone (ranks could "
    "clip by different factors and disagree on a skip); use FSDP2 (per-parameter DTensor shards, summed over ranks)"
)
_FIX_ARGS = (
    "set `fsdp_version: 2` in the FSDP config: in the recipe `training.fsdp_config: {fsdp_version: 2, ...}` "
    "(`--training.fsdp_config '{fsdp_version: 2}'`), in a script `TrainingArguments(fsdp_config={'fsdp_version': 2})`"
)
_FIX_ENV = (
    "add `fsdp_version: 2` under `fsdp_config:` in the accelerate config file given to `accelerate launch "
    "--config_file` (a config without it means version 1; see configs/accelerate/fsdp2.yaml), or export FSDP_VERSION=2"
)


def fsdp1_source(args=None, model=None, plugin=None) -> str | None:
    """What makes this run FSDP1, in words, or None (FSDP2, DeepSpeed, DDP, one process).

    Looked at in order: an FSDP1-wrapped `model`; `args.fsdp` with its config's version (TrainingArguments defaults
    to 2; the Trainer builds its plugin from it); accelerate's FSDP plugin (`plugin`, else the one of this process's
    `Accelerator` once one exists - then it is the answer, as accelerate has read the launcher's environment); and
    before any `Accelerator`, the launcher's environment (`ACCELERATE_USE_FSDP` with `FSDP_VERSION`, which accelerate
    defaults to 1).
    """
    # FSDP1's flat parameters (use_orig_params=False) and its views of the originals (True) live only inside
    # FullyShardedDataParallel modules, so the module class finds both without FSDP1's private flags
    if model is not None and any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return "the model is wrapped in FSDP1's FullyShardedDataParallel"
    plugin_args = getattr(args, "fsdp_plugin_args", None) if args is not None and getattr(args, "fsdp", None) else None
    if plugin_args:
        version = int(plugin_args.get("fsdp_version", 2))
        return f"TrainingArguments.fsdp_config has fsdp_version {version}" if version == 1 else None
    built, state_plugin = _accelerate_fsdp_plugin()
    plugin = plugin if plugin is not None else state_plugin
    if plugin is not None:
        version = getattr(plugin, "fsdp_version", 1)
        return f"accelerate's FSDP plugin has fsdp_version {version}" if version == 1 else None
    if built:  # accelerate has decided (its own ACCELERATE_USE_FSDP, set once it builds a plugin, says nothing more)
        return None
    import os

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        version = int(os.environ.get("FSDP_VERSION", "1") or 1)
        if version == 1:
            set_by = "FSDP_VERSION=1" if "FSDP_VERSION" in os.environ else "FSDP_VERSION unset, which means 1"
            return f"the launcher's environment asks for FSDP (ACCELERATE_USE_FSDP) with {set_by}"
    return None


def refuse_fsdp1(args=None, model=None) -> None:
    """Stop before the first step when the run would train with FSDP1 (see `fsdp1_source`).

    Called by the recipe right after `TrainingArguments` (`distributed.prepare_launch`), by `build_callbacks` and
    `StableTrainer` (before accelerate's own FSDP set-up, which on CPU ranks fails for FSDP1 with a device error), at
    every hf_stable callback's `on_train_begin`, and by `StepEngine.of`.

    Raises:
        ConfigError: naming what asked for FSDP1 and the config line that selects FSDP2.
    """
    source = fsdp1_source(args, model)
    if source is None:
        return
    from hf_stable.errors import ConfigError

    from_env = source.startswith("the launcher")
    raise ConfigError(f"fsdp_version: {source}. {_FSDP1_WHY}. To fix: {_FIX_ENV if from_env else _FIX_ARGS}")


def _accelerate_fsdp_plugin() -> tuple[bool, object]:
    """(whether this process has built an `Accelerator`, its FSDP plugin or None)."""
    try:
        from accelerate.state import AcceleratorState, is_initialized
    except ImportError:
        return False, None
    if not is_initialized():
        return False, None
    return True, getattr(AcceleratorState(), "fsdp_plugin", None)


__all__ = ["DeepSpeedEngine", "FSDP2Engine", "StepEngine", "fsdp1_source", "refuse_fsdp1"]
