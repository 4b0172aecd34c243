"""`PreemptionCallback`: on SIGTERM (or another chosen signal) save a checkpoint at the next step boundary and stop.

Schedulers stop jobs with a signal and a grace period (Kubernetes: SIGTERM, then SIGKILL 30 s later by
default; SLURM: `--signal=USR1@120`; torchrun forwards SIGTERM to its workers). Dying mid-step loses
everything since the last periodic checkpoint. Instead, the signal handler only sets a flag; at the end of
the current optimizer step every rank all-reduces it, so all ranks agree to save and stop at the same step
— a rank that stopped alone would leave the others waiting forever in the next collective.

After `trainer.train()` returns, `exit_if_preempted` marks the output dir as preempted (not finished) and
exits with `exit_code` (default 143 = 128 + SIGTERM), so the recipe does not evaluate or write a model card
for a half-trained model and the scheduler / torchrun restarts the job, which resumes (`runtime.resume: auto`).

Outside the training loop (loading the model and data, evaluating, writing the outputs) there is no step to
finish and nothing to save: `stop_on_signals`, around the recipe's work from the start of the output dir, turns
the signal into `hf_stable.errors.Preempted`, which the recipe's error boundary records as "preempted" in
RUN_INCOMPLETE.json before it exits with `exit_code` (without it the default action would kill the process and
leave the run marked "running").

The grace period must cover the rest of one optimizer step plus one checkpoint save. A second copy of the
same signal within `DUPLICATE_SECONDS` is the same request arriving twice (a process-group kill plus the
launcher forwarding it, see `hf_stable.launcher`) and is ignored; a later one gives up and lets the previous
handler (normally: die) run.

Ctrl-C (SIGINT, in the default signals) is the same request made by a person: the first press is acknowledged at
once on the main process ("Ctrl-C: saving a checkpoint at the end of this step ..."), the run saves at the next
step boundary (whatever `save_strategy` says), is marked "interrupted" and exits 130, the shell's status for
Ctrl-C. A terminal sends one press to the whole foreground process group, so under `accelerate launch` with one
process the worker gets it from the terminal and again from the launcher within milliseconds; the duplicate window
for SIGINT is `DUPLICATE_SECONDS_INTERACTIVE`, short enough that a second press after the acknowledgement is a
second press: it stops the run at once, without saving, marked "interrupted" (exit 130, no traceback).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from hf_stable.callbacks.base import StabilityCallback
from hf_stable.config.runtime import PreemptionConfig
from hf_stable.distributed import all_reduce_scalar, shutdown
from hf_stable.errors import Preempted
from hf_stable.logging import get_logger, is_main_process, print_main

logger = get_logger(__name__)

DUPLICATE_SECONDS = 5.0
DUPLICATE_SECONDS_INTERACTIVE = 1.0  # SIGINT: a person reads the acknowledgement before pressing again
INTERRUPT_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C

# The last signal any handler of this module took, shared by the training-step handler and `stop_on_signals`: the
# duplicate of a press can arrive after training ended and the other handler is back (a save done within the window)
_last: dict = {"signum": None, "at": 0.0}


def _window(signum: int) -> float:
    return DUPLICATE_SECONDS_INTERACTIVE if signum == signal.SIGINT else DUPLICATE_SECONDS


def _duplicate(signum: int) -> bool:
    """True when `signum` is a copy of the last signal taken (same number, within its window); else records it."""
    now = time.monotonic()
    if _last["signum"] == signum and now - _last["at"] < _window(signum):
        return True
    _last["signum"], _last["at"] = signum, now
    return False


def stop_word(signal_name: str) -> str:
    """How a stop by `signal_name` is called in messages and RUN_INCOMPLETE.json: Ctrl-C "interrupted" a run, any
    other signal "preempted" it."""
    return "interrupted" if signal_name == "SIGINT" else "preempted"


def stop_exit_code(signal_name: str, configured: int) -> int:
    """The exit status after a stop by `signal_name`: 130 for Ctrl-C (the shell's convention), else `configured`."""
    return INTERRUPT_EXIT_CODE if signal_name == "SIGINT" else int(configured)


def _say(text: str) -> None:
    # from a signal handler: straight to the file descriptor (print could re-enter a write the handler interrupted)
    with contextlib.suppress(OSError):
        os.write(sys.stdout.fileno(), text.encode())


class PreemptionCallback(StabilityCallback):
    """Turns a termination signal into "save a checkpoint, then stop" at the next optimizer-step boundary.

    Args:
        config: a `PreemptionConfig` (default `PreemptionConfig()`: `signals` to handle, the `exit_code`
            `exit_if_preempted` uses after the save, `enabled`: when False no handler is installed).
        **overrides: `PreemptionConfig` fields to change, e.g. `PreemptionCallback(signals=["SIGUSR1"])`.

    Raises:
        ValueError: a name in `signals` is not a signal of this platform.

    Example:
        >>> cb = PreemptionCallback(signals=["SIGTERM"])
        >>> trainer = Trainer(..., callbacks=[cb, CheckpointMarker()])  # or build_callbacks(cfg, args)
        >>> trainer.train(resume_from_checkpoint=resolve_resume("auto", args))
        >>> exit_if_preempted(trainer, output)        # SystemExit(143) when a signal stopped training
    """

    def __init__(self, config: PreemptionConfig | None = None, **overrides):
        super().__init__()
        cfg = self._use_config(PreemptionConfig, config, overrides)
        self.signals = tuple(cfg.signals)
        self.exit_code = int(cfg.exit_code)
        self._signums = [self._signum(name) for name in self.signals]
        self._received: int | None = None
        self._received_at = 0.0
        self._previous: dict[int, object] = {}
        self._stopped_at: int | None = None
        self._stop_signal: str | None = None  # the signal every rank agreed on at the stop
        self._preemptions = 0
        self._owner = os.getpid()
        self._main = True

    @staticmethod
    def _signum(name: str) -> int:
        if name not in signal.Signals.__members__:
            raise ValueError(f"signals: {name!r} is not a signal on this platform")
        return int(signal.Signals[name])

    # --- state --------------------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """True when this run's training loop was stopped by a signal (a checkpoint was saved)."""
        return self._stopped_at is not None

    @property
    def stopped_at(self) -> int | None:
        return self._stopped_at

    @property
    def pending(self) -> bool:
        """True when a signal arrived that the next optimizer-step boundary will act on."""
        return self._received is not None and self._stopped_at is None

    def state_dict(self) -> dict:
        return {"preemptions": self._preemptions}

    def load_state_dict(self, state: dict) -> None:
        self._preemptions = int(state.get("preemptions", 0))

    # --- signal handling ----------------------------------------------------------------
    def _handle(self, signum, frame) -> None:
        # Only set a flag: the handler runs between two bytecodes of the training step, anything more
        # (a collective, a save) could run in the middle of a backward pass.
        if os.getpid() != self._owner:  # a forked DataLoader worker: its parent stops it
            return
        if _duplicate(signum):
            return
        if self._received == signum:  # asked again, after the acknowledgement / the duplicate window
            if signum == signal.SIGINT:
                raise Preempted("SIGINT", INTERRUPT_EXIT_CODE, note="a second Ctrl-C stopped it at once")
            _last["signum"] = None  # the previous handler (`stop_on_signals`) must not take it for a duplicate
            previous = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)
            return
        self._received, self._received_at = signum, time.monotonic()
        if signum == signal.SIGINT and self._main:
            _say(
                "\nCtrl-C: saving a checkpoint at the end of this step (Ctrl-C again stops at once, without saving)\n"
            )

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("preemption: the Trainer runs outside the main thread, so signals cannot be handled")
            return
        _last["signum"] = None  # a new run of handlers: nothing taken yet is a copy of an earlier request
        for signum in self._signums:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    # --- Trainer hooks -------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._received, self._stopped_at, self._stop_signal = None, None, None
        self._owner, self._main = os.getpid(), is_main_process()
        if self.enabled:
            self._install()

    def on_step_end(self, args, state, control, **kwargs):
        # Every rank calls the all-reduce at every optimizer step, whether or not it got a signal; the agreed
        # signal is the largest number any rank got (a SIGTERM outranks a Ctrl-C), so every rank exits alike.
        if not self.enabled or self._stopped_at is not None:
            return super().on_step_end(args, state, control, **kwargs)
        agreed = int(all_reduce_scalar(float(self._received or 0), "max"))
        if agreed:
            control.should_save = True  # also when save_strategy is "no"
            control.should_training_stop = True
            self._stopped_at = state.global_step
            self._stop_signal = signal.Signals(agreed).name
            self._preemptions += 1
            # The same message on every rank (only the main process writes it, but events are compared).
            self.event(
                state.global_step,
                "preemption",
                f"{self._stop_signal} received: saving checkpoint-{state.global_step} and stopping; "
                "rerun the same command to resume",
                severity="warning",
            )
        super().on_step_end(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        self._restore()
        super().on_train_end(args, state, control, **kwargs)


# outside training, how long a signal may wait for the main thread (blocked in a C call: a collective, a kernel)
# to take it before the process records "preempted" and exits anyway, as the default action would have at once
STUCK_SECONDS = 10.0


def _watch(read_fd: int, ours: dict, exit_code: int, output) -> None:
    """Thread: the wakeup fd gets each signal's number at once, even while the main thread is blocked in C (then
    its Python handler waits). One of ours, still handled by `stop` after STUCK_SECONDS: exit without it."""
    try:
        while data := os.read(read_fd, 64):
            for signum in data:
                if _waits(signum, ours):
                    time.sleep(STUCK_SECONDS)
                    if _waits(signum, ours):  # else: the main thread took it, or the block ended
                        _exit_stuck(signum, exit_code, output)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(read_fd)


def _waits(signum: int, ours: dict) -> bool:
    # not ours, or training (the PreemptionCallback's flag, acted on at the step's end): nothing to do
    return signum in ours and signal.getsignal(signum) is ours[signum]


def _exit_stuck(signum: int, exit_code: int, output) -> None:
    name = signal.Signals(signum).name
    if output is not None:
        output.preempted(name, step=None, note=f"blocked for {STUCK_SECONDS:.0f} s in a C call: nothing was saved")
    print_main(
        f"\n{stop_word(name)}: {name} received while blocked in a C call, nothing to save; rerun the same command"
    )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(stop_exit_code(name, exit_code))


@contextlib.contextmanager
def stop_on_signals(config: PreemptionConfig | None = None, output=None):
    """While the block runs, make `config.signals` raise `Preempted` (which `hf_stable.outputs.error_boundary`
    records as "preempted"), except during training, where a `PreemptionCallback` takes them over. Yields the
    signals handled (none when `config.enabled` is False, or outside the main thread, where signals cannot be
    handled); the previous handlers come back when the block ends.

    A main thread blocked in a C call (a collective waiting for a rank that is gone) cannot run a Python handler:
    after `STUCK_SECONDS` the process records "preempted" in `output` (an `OutputDir`) and exits with the exit
    code, so a signal still ends it (a launcher's parent-death signal, a scheduler's SIGTERM).

    Example:
        >>> with error_boundary(output), stop_on_signals(cfg.runtime.preemption, output):
        ...     output.start(cfg.to_dict())   # a SIGTERM from here on while loading data: "preempted", exit 143
    """
    cfg = config or PreemptionConfig()
    handled = list(cfg.signals) if cfg.enabled and threading.current_thread() is threading.main_thread() else []
    exit_code = int(cfg.exit_code)
    owner = os.getpid()

    def stop(signum, frame):
        if os.getpid() != owner:  # a forked child (a DataLoader worker) inherited the handler: the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if _duplicate(signum):  # the same press or request again (process group + launcher): being handled
            return
        name = signal.Signals(signum).name
        raise Preempted(name, stop_exit_code(name, exit_code))

    previous, ours, wakeup, old_fd = {}, {}, None, -1
    _last["signum"] = None
    try:
        for name in handled:
            signum = PreemptionCallback._signum(name)
            previous[signum] = signal.signal(signum, stop)
            ours[signum] = stop
        if ours:
            wakeup = os.pipe()
            os.set_blocking(wakeup[1], False)
            old_fd = signal.set_wakeup_fd(wakeup[1], warn_on_full_buffer=False)
            threading.Thread(target=_watch, args=(wakeup[0], ours, exit_code, output), daemon=True).start()
        yield handled
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if wakeup is not None:
            signal.set_wakeup_fd(old_fd)
            os.close(wakeup[1])  # the watcher reads EOF and ends


def find_preemption(trainer) -> PreemptionCallback | None:
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PreemptionCallback)), None)


def exit_if_preempted(trainer, output=None) -> None:
    """After `trainer.train()`: if a signal stopped training, record it and exit with the callback's code.

    Args:
        trainer: the Trainer (its callbacks are searched for a `PreemptionCallback`).
        output: the run's `hf_stable.outputs.OutputDir`; its RUN_INCOMPLETE.json gets status "preempted"
            ("interrupted" after Ctrl-C).

    Raises:
        SystemExit: with `PreemptionCallback.exit_code` (130 after Ctrl-C), on every rank, when training was
            preempted.
    """
    callback = find_preemption(trainer)
    if callback is None or not callback.stopped:
        return
    step = callback.stopped_at
    checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
    name = callback._stop_signal or "/".join(callback.signals)  # the signal every rank agreed on
    if output is not None:
        output.preempted(name, step=step, checkpoint=checkpoint)
    print_main(f"\n{stop_word(name)}: saved {checkpoint} at step {step}; rerun the same command to resume")
    shutdown()
    raise SystemExit(stop_exit_code(name, callback.exit_code))
