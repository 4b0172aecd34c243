"""Code of ours in the launcher process (`accelerate launch`, `torchrun`) and at the start of its workers.

Schedulers (Kubernetes, most batch systems) signal only the job's main process, which is the launcher, and
the launchers do not turn that into a checkpoint (accelerate 1.15 / torch 2.13):

* `accelerate launch` with one process (`simple_launcher`) runs the worker with `Popen` + `wait`: a SIGTERM
  kills the launcher and the worker trains on, orphaned. A worker exiting non-zero (a bad config: exit 2)
  ends in accelerate's `CalledProcessError` traceback and exit 1.
* `torchrun` and `accelerate launch` with several processes run torch elastic's agent in the launcher: it
  forwards the signals in `--signals_to_handle` (SIGTERM, SIGINT, SIGHUP, SIGQUIT), gives the workers
  `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (30 s) before SIGKILL, then dies with a `SignalException` traceback, exit 1.

The package installs `hf_stable_launcher.pth` (see setup.py), whose one line calls `startup()` in launcher
processes and in workers a launcher started; `startup` returns at once unless the launched script mentions
`hf_stable`. In such a launcher it:

* forwards SIGTERM and `runtime.preemption.signals` (read from the launched `--config` and overrides) to the
  worker (one process), or lets the elastic agent forward them too, and waits for the workers, which finish
  their step and save (`PreemptionCallback`); torch elastic waits `runtime.preemption.grace_seconds`;
* exits with the workers' status and no launcher traceback: the preemption exit code (143) after a forwarded
  signal, 2 after a bad config (our one-line message is the only output), a crash's code otherwise (torch
  elastic's failure report is kept for crashes: there it is the useful part);
* sets `HF_STABLE_LAUNCHER_PID` so that each worker, at its start, asks Linux for a signal when its parent
  dies (`prctl(PR_SET_PDEATHSIG)`): a launcher killed with SIGKILL leaves no orphan training on; the worker
  gets the preemption signal, saves at its next step boundary and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHER_ENV = "HF_STABLE_LAUNCHER_PID"
DEATH_SIGNAL_ENV = "HF_STABLE_PARENT_DEATH_SIGNAL"
_SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_ELASTIC_SIGNALS_ENV = "PET_SIGNALS_TO_HANDLE"  # the default of torchrun's --signals_to_handle
_ELASTIC_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_ACCELERATE = ("accelerate", "accelerate.commands.accelerate_cli")  # followed by the `launch` subcommand
_LAUNCHERS = ("accelerate-launch", "accelerate.commands.launch", "torchrun", "torch.distributed.run")
_SCRIPT_BYTES = 1 << 20  # how much of the launched script is read to see whether it uses hf_stable


@dataclass
class Launch:
    """A launcher command line: which launcher, the training script and the script's own arguments."""

    launcher: str
    script: Path
    script_args: list[str] = field(default_factory=list)


@dataclass
class _LauncherState:
    signals: tuple[str, ...] = ("SIGTERM",)
    preemption_signals: tuple[str, ...] = ()
    exit_code: int = 143
    exit_with: int | None = None


_state: _LauncherState | None = None


def parse_launch(argv: list[str]) -> Launch | None:
    """The launch in `argv` (`sys.orig_argv`), or None when this is no launcher running a `.py` script."""
    for i, arg in enumerate(argv[:4]):
        name = os.path.basename(arg)
        if name in _ACCELERATE and argv[i + 1 : i + 2] == ["launch"]:
            rest = argv[i + 2 :]
        elif name in _LAUNCHERS:
            rest = argv[i + 1 :]
        else:
            continue
        for j, token in enumerate(rest):
            if token.endswith(".py") and not token.startswith("-"):
                return Launch(name, Path(token), list(rest[j + 1 :]))
        return None
    return None


def uses_hf_stable(script: Path) -> bool:
    try:
        with open(script, "rb") as fh:
            return b"hf_stable" in fh.read(_SCRIPT_BYTES)
    except OSError:
        return False


def preemption_settings(script_args: list[str]):
    """`runtime.preemption` of the launched run (its `--config` and `--runtime.*` overrides), else the defaults.

    Only the YAML and the `runtime` section are read (no transformers import in the launcher); a config the
    worker will refuse gives the defaults here, and the worker reports the problem.
    """
    from hf_stable.config.loader import build_section, parse_overrides, set_dotted
    from hf_stable.config.run import DEFAULT_CONFIG, read_recipe
    from hf_stable.config.runtime import PreemptionConfig, RuntimeConfig

    with contextlib.suppress(Exception):  # the worker reports a broken config; the launcher must still start
        path, overrides = parse_overrides(script_args)
        data = read_recipe(Path(path or DEFAULT_CONFIG))
        for key, value in overrides:
            if key.startswith("runtime."):
                set_dotted(data, key, value)
        problems: list[str] = []
        runtime = build_section(RuntimeConfig, data.get("runtime") or {}, "runtime", problems)
        if not problems and isinstance(runtime, RuntimeConfig):
            return runtime.preemption
    return PreemptionConfig()


# ---- launcher side ------------------------------------------------------------------------------------


def _forward(signum, frame) -> None:
    """Pass the signal to the worker processes and keep waiting for them (they save, then exit)."""
    import psutil

    children = psutil.Process().children()
    if not children:  # nothing started yet, or already gone: nothing to save
        raise SystemExit(128 + signum)
    for child in children:
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def exit_code_for(exc: BaseException, state: _LauncherState) -> int | None:
    """The launcher's exit status for an exception its launcher code raised, or None to keep its traceback.

    * `CalledProcessError` (accelerate, one process): the worker's status (128 + N when a signal killed it).
    * `SignalException` (torch elastic forwarded a signal and waited): the preemption exit code when the
      signal is a preemption signal, else 128 + the signal (SIGINT, Ctrl-C: always 130).
    * `ChildFailedError` (torch elastic, a worker failed): 2 when the first failure is a config/data error
      (exit 2), the preemption exit code when every failure is that code, or that code on some workers and, on
      the others, the SIGTERM the agent sends the rest once one worker has exited (a preempted rank that left
      first: every rank has passed the save and the exit barrier by then); a crash keeps its report.
    """
    name = type(exc).__name__
    if name == "CalledProcessError":
        code = int(getattr(exc, "returncode", 1))
        return code if code > 0 else 128 - code
    if name == "SignalException":
        sig = signal.Signals(int(getattr(exc, "sigval", signal.SIGTERM)))
        if sig.name in state.preemption_signals and sig != signal.SIGINT:
            return state.exit_code
        return 128 + int(sig)  # Ctrl-C: 130 whether the workers saved (a preemption signal) or not
    if name == "ChildFailedError":
        failures = getattr(exc, "failures", None) or {}
        codes = [getattr(f, "exitcode", None) for f in failures.values()]
        try:
            first = exc.get_first_failure()[1].exitcode
        except Exception:  # noqa: BLE001
            first = codes[0] if codes else None
        if first == 2:
            return 2
        terminated = -int(signal.SIGTERM)  # how elastic reports a worker it stopped itself
        for stopped in (state.exit_code, 128 + int(signal.SIGINT)):  # a preemption, a Ctrl-C (130)
            if stopped in codes and all(c in (stopped, terminated) for c in codes):
                return stopped
    return None


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        code = exit_code_for(exc, _state) if _state is not None else None
        if code is None:
            return previous(exc_type, exc, tb)
        _state.exit_with = code  # the workers already said what happened; `_exit_last` ends with their code

    return hook


def _exit_last() -> None:
    # Registered before anything else in this process, so it runs after every other atexit handler.
    if _state is not None and _state.exit_with is not None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(_state.exit_with)


# accelerate's launcher lists the launch values it filled in itself; for one process on one machine these are the
# values hf_stable's recipe runs with (the recipe's YAML decides precision and compilation): a block of noise on the
# README's launch. Any other filled-in value (several processes, CPU threads, several GPUs found) keeps the block.
_ACCELERATE_DEFAULTS = "The following values were not passed to `accelerate launch` and had defaults used instead:"
_PLAIN_DEFAULTS = (
    "\t`--num_processes` was set to a value of `0`",  # no GPU: accelerate's count of CUDA devices; one process runs
    "\t`--num_processes` was set to a value of `1`",
    "\t`--num_machines` was set to a value of `1`",
    "\t`--mixed_precision` was set to a value of `'no'`",
    "\t`--dynamo_backend` was set to a value of `'no'`",
)


class PlainLaunchDefaults:
    """A `logging` filter for accelerate's launch logger that drops its defaults block when it lists only the plain
    one-process defaults above (see `_PLAIN_DEFAULTS`)."""

    def filter(self, record) -> bool:
        text = record.getMessage()
        if not text.startswith(_ACCELERATE_DEFAULTS):
            return True
        listed = [line for line in text.splitlines()[1:] if not line.startswith("To avoid this warning")]
        return not all(line in _PLAIN_DEFAULTS for line in listed)


def install_in_launcher(launch: Launch) -> None:
    """Forward signals to the workers, wait for them, and exit with their status (see the module docstring)."""
    global _state
    if _state is not None:
        return
    pre = preemption_settings(launch.script_args)
    preemption = tuple(pre.signals) if pre.enabled else ()
    signals = tuple(dict.fromkeys(("SIGTERM", *preemption)))
    _state = _LauncherState(signals=signals, preemption_signals=preemption, exit_code=pre.exit_code)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    os.environ[DEATH_SIGNAL_ENV] = (preemption or ("SIGTERM",))[0]
    # torch elastic installs its own handlers when it starts the workers: widen the set it forwards and give
    # the workers the grace period (an explicit --signals_to_handle / environment value is the user's choice)
    handled = os.environ.get(_ELASTIC_SIGNALS_ENV, ",".join(_ELASTIC_DEFAULT_SIGNALS)).split(",")
    os.environ[_ELASTIC_SIGNALS_ENV] = ",".join(dict.fromkeys([*handled, *signals]))
    os.environ.setdefault(_SHUTDOWN_ENV, str(int(pre.grace_seconds)))
    for name in signals:
        signal.signal(signal.Signals[name], _forward)
    sys.excepthook = _excepthook(sys.excepthook)
    atexit.register(_exit_last)
    if launch.launcher.startswith("accelerate"):
        import logging

        logging.getLogger("accelerate.commands.launch").addFilter(PlainLaunchDefaults())


# ---- worker side --------------------------------------------------------------------------------------


def set_parent_death_signal(signame: str = "SIGTERM", parent: int | None = None) -> bool:
    """Ask Linux to send `signame` to this process when its parent dies (`prctl(PR_SET_PDEATHSIG)`).

    Returns False where that does not exist (not Linux). If `parent` already died before the call, the
    signal is sent at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    signum = int(signal.Signals[signame])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signum, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        return False
    if parent is not None and os.getppid() != parent:  # the launcher died before the prctl
        os.kill(os.getpid(), signum)
    return True


def install_in_worker() -> None:
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit() and int(launcher) == os.getppid():
        set_parent_death_signal(os.environ.get(DEATH_SIGNAL_ENV, "SIGTERM"), parent=int(launcher))


def startup() -> None:
    """Called by `hf_stable_launcher.pth` at interpreter start; does nothing outside hf_stable launches."""
    with contextlib.suppress(Exception):  # a startup hook must never stop Python from starting
        install_in_worker()
        launch = parse_launch(list(getattr(sys, "orig_argv", None) or []))
        if launch is not None and uses_hf_stable(launch.script):
            install_in_launcher(launch)
