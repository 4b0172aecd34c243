"""Preemption through the launchers the README documents: the signal goes to the launcher process only.

`accelerate launch` (one process: accelerate's `simple_launcher`; two: torch elastic inside accelerate) and
`torchrun` get SIGTERM while every rank is held at the end of a step (the probe's `pause:` fault); each worker
must finish the next step, save a complete checkpoint and exit 143, the launcher too, with no traceback; the
reruns chain from those checkpoints and must end bit for bit where an uninterrupted run ends. A launcher
killed with SIGKILL must not leave its worker training on (`prctl(PR_SET_PDEATHSIG)`): the worker saves and
stops by itself. The mechanism is `hf_stable/launcher.py`, installed as `hf_stable_launcher.pth`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from hf_stable.checkpoints import checkpoint_problems
from hf_stable.launcher import exit_code_for, parse_launch, preemption_settings
from tests.dist_scripts.harness import (
    baseline_run,
    ddp_args,
    ddp_reference_run,
    launch,
    load_adapter,
    recipe_args,
    signal_launcher,
)

ROOT = Path(__file__).resolve().parents[1]
CPU_2PROC = "configs/accelerate/cpu-2proc.yaml"


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _stopped_cleanly(stop: dict, step: int, ranks: int, code: int = 143, status: str = "preempted") -> list[str]:
    """What is wrong with a launch that a signal to its launcher should have stopped after `step`."""
    run, problems = stop["run"], []
    if run.returncode != code:
        problems.append(f"launcher exit {run.returncode}, not {code}")
    if "Traceback" in run.stderr:
        problems.append("a traceback on stderr")
    if run.exit_codes() != dict.fromkeys(range(ranks), code):
        problems.append(f"worker exits {run.exit_codes()}")
    if [r["global_step"] for r in run.ranks()] != [step] * ranks:
        problems.append(f"ranks stopped at {[r['global_step'] for r in run.ranks()]}, not {step}")
    if (stop["status"] or {}).get("status") != status or stop["status"].get("step") != step:
        problems.append(f"RUN_INCOMPLETE.json is {stop['status']}")
    if checkpoint_problems(run.out / f"checkpoint-{step}"):
        problems.append(f"checkpoint-{step}: {checkpoint_problems(run.out / f'checkpoint-{step}')}")
    return problems


# ---- the startup hook itself (no launch) ----------------------------------------------------------------------


def test_the_hook_is_installed_and_costs_other_processes_nothing():
    pth = Path(sysconfig.get_paths()["purelib"]) / "hf_stable_launcher.pth"
    assert pth.is_file(), "reinstall the package (pip install -e .): setup.py ships hf_stable_launcher.pth"
    code = "import sys; print('hf_stable' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"] and not out.stderr


def test_parse_launch_finds_the_script_of_every_documented_launcher():
    script = str(ROOT / "scripts" / "finetune.py")
    cases = {
        ("py", "/v/bin/accelerate", "launch", "--num_processes", "1", script, "--config", "c.yaml"): "accelerate",
        ("py", "/v/bin/accelerate", "launch", "--config_file", "a.yaml", script): "accelerate",
        ("py", "/v/bin/torchrun", "--standalone", "--nproc_per_node", "2", script, "--x", "1"): "torchrun",
        ("py", "-m", "torch.distributed.run", "--nproc_per_node", "2", script): "torch.distributed.run",
    }
    for argv, launcher in cases.items():
        found = parse_launch(list(argv))
        assert found is not None and found.launcher == launcher and str(found.script) == script, argv
    assert parse_launch(["py", "/v/bin/torchrun", script, "--config", "c.yaml"]).script_args == ["--config", "c.yaml"]
    for other in (["py", "/v/bin/accelerate", "config"], ["py", script], ["py", "-c", "pass"], []):
        assert parse_launch(other) is None, other


def test_launcher_reads_the_runs_preemption_settings(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("# t\nruntime:\n  preemption:\n    signals: [SIGUSR1]\n    grace_seconds: 300\n")
    pre = preemption_settings(["--config", str(cfg), "--runtime.preemption.exit_code", "99", "--lora.r", "4"])
    assert (pre.signals, pre.grace_seconds, pre.exit_code) == (["SIGUSR1"], 300, 99)
    assert preemption_settings(["--config", str(tmp_path / "missing.yaml")]).signals == [
        "SIGTERM",
        "SIGINT",
    ]  # defaults


def test_launcher_exit_status_follows_the_workers():
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    state = SimpleNamespace(preemption_signals=("SIGTERM",), exit_code=143)

    def failed(*codes):
        failures = {
            r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c, error_file="") for r, c in enumerate(codes)
        }
        return ChildFailedError("finetune.py", failures)

    assert exit_code_for(subprocess.CalledProcessError(2, ["python"]), state) == 2  # bad config: our message only
    assert exit_code_for(subprocess.CalledProcessError(143, ["python"]), state) == 143
    assert exit_code_for(subprocess.CalledProcessError(-9, ["python"]), state) == 137  # worker killed by SIGKILL
    assert exit_code_for(SignalException("x", sigval=signal.SIGTERM), state) == 143
    assert exit_code_for(SignalException("x", sigval=signal.SIGINT), state) == 130  # not a preemption signal
    ctrl_c = SimpleNamespace(preemption_signals=("SIGTERM", "SIGINT"), exit_code=143)
    assert exit_code_for(SignalException("x", sigval=signal.SIGINT), ctrl_c) == 130  # Ctrl-C: saved, then 130
    assert exit_code_for(SignalException("x", sigval=signal.SIGTERM), ctrl_c) == 143
    assert exit_code_for(failed(130, 130), ctrl_c) == 130 and exit_code_for(failed(-15, 130), ctrl_c) == 130
    assert exit_code_for(failed(2, 2), state) == 2
    assert exit_code_for(failed(143, 143), state) == 143
    # one preempted rank left first and the agent stopped the other, still exiting (seen under DeepSpeed)
    assert exit_code_for(failed(-15, 143), state) == 143
    assert exit_code_for(failed(-15, -15), state) is None  # stopped by someone else: keep the report
    assert exit_code_for(failed(1, 143), state) is None  # a crash keeps torch elastic's failure report
    assert exit_code_for(ValueError("bug"), state) is None


def test_a_duplicate_signal_does_not_abandon_the_save():
    """A process-group kill plus the launcher's forward deliver the same SIGTERM twice within milliseconds."""
    from hf_stable.callbacks.preemption_callback import PreemptionCallback

    cb = PreemptionCallback(signals=["SIGUSR1"])
    cb._install()
    try:
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)  # the default action would end this process
        assert cb.pending and signal.getsignal(signal.SIGUSR1) == cb._handle
    finally:
        cb._restore()


# ---- one process: accelerate launch (simple_launcher) ------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """SIGTERM to `accelerate launch` at step 3, SIGKILL to it at step 6 (resumed), then a resume to the end."""
    out = tmp_path_factory.mktemp("accelerate1") / "out"
    args = recipe_args(out, save_steps=2)  # the baseline run's arguments
    term = signal_launcher(args, out, signal.SIGTERM, after_step=2, launcher="accelerate", tag="term")
    kill = signal_launcher(args, out, signal.SIGKILL, after_step=5, launcher="accelerate", tag="kill")
    resumed = launch(args, out, launcher="accelerate", tag="resume")
    return SimpleNamespace(out=out, term=term, kill=kill, resumed=resumed)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_accelerate_launch_reaches_the_worker(one_process):
    assert _stopped_cleanly(one_process.term, step=3, ranks=1) == [], one_process.term["run"].tail()
    assert "preempted: saved" in one_process.term["run"].output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_to_accelerate_launch_leaves_no_worker_training_on(one_process):
    kill = one_process.kill
    run = kill["run"]
    assert run.returncode == -signal.SIGKILL
    # the worker noticed its launcher die, finished the step, saved and stopped by itself, quickly
    assert kill["seconds"] < 120 and run.exit_codes() == {0: 143}, run.tail()
    assert not [p for p in kill["workers"] if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert [r["global_step"] for r in run.ranks()] == [6] and checkpoint_problems(
        one_process.out / "checkpoint-6"
    ) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_process_reruns_end_bitwise_where_an_uninterrupted_run_ends(one_process):
    resumed = one_process.resumed
    assert resumed.returncode == 0 and "resuming from" in resumed.output and "checkpoint-6" in resumed.output
    assert _same(load_adapter(one_process.out), load_adapter(baseline_run().out))
    assert (one_process.out / "run_summary.json").is_file() and not (one_process.out / "RUN_INCOMPLETE.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_config_under_accelerate_launch_shows_only_our_message(tmp_path):
    out = tmp_path / "out"
    run = launch(recipe_args(out) + ["--training.per_device_train_batch_size", "0"], out, launcher="accelerate")
    assert run.returncode == 2, run.tail()
    assert "training.per_device_train_batch_size: got 0, must be >= 1" in run.stderr
    assert "Traceback" not in run.stderr and "CalledProcessError" not in run.stderr


# ---- two processes: accelerate launch (torch elastic) then torchrun, chained ----------------------------------


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """SIGTERM to `accelerate launch` (2 ranks) at step 2, to `torchrun` (resumed) at step 4, then the end."""
    out = tmp_path_factory.mktemp("launch2") / "out"
    args = ddp_args(out)
    accel = signal_launcher(
        args,
        out,
        signal.SIGTERM,
        after_step=1,
        nproc=2,
        launcher="accelerate",
        accelerate_config=CPU_2PROC,
        tag="accelerate",
    )
    torchrun = signal_launcher(args, out, signal.SIGTERM, after_step=3, nproc=2, launcher="torchrun", tag="torchrun")
    resumed = launch(args, out, nproc=2, tag="resume")
    return SimpleNamespace(out=out, accel=accel, torchrun=torchrun, resumed=resumed)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_sigterm_to_the_launcher_stops_both_ranks_with_a_checkpoint(two_processes):
    for stop, step in ((two_processes.accel, 2), (two_processes.torchrun, 4)):
        assert _stopped_cleanly(stop, step=step, ranks=2) == [], stop["run"].tail()
    assert "SignalException" not in two_processes.torchrun["run"].output


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_two_rank_reruns_end_bitwise_where_an_uninterrupted_run_ends(two_processes):
    resumed = two_processes.resumed
    assert resumed.returncode == 0, resumed.tail()
    assert "checkpoint-4" in resumed.output
    assert _same(load_adapter(two_processes.out), load_adapter(ddp_reference_run().out))


# ---- Ctrl-C: SIGINT to the launch's process group, as a terminal sends it ------------------------------------------


def _interrupted_cleanly(stop: dict, step: int, ranks: int) -> list[str]:
    """`_stopped_cleanly` for Ctrl-C: exit 130, "interrupted", the one line, no KeyboardInterrupt anywhere."""
    run = stop["run"]
    problems = _stopped_cleanly(stop, step=step, ranks=ranks, code=130, status="interrupted")
    line = f"interrupted: saved {run.out / f'checkpoint-{step}'} at step {step}; rerun the same command to resume"
    if run.output.count(line) != 1:
        problems.append(f"not once: {line!r}")
    if "Traceback" in run.output or "KeyboardInterrupt" in run.output:
        problems.append("a traceback or KeyboardInterrupt in the output")
    if run.output.count("Ctrl-C: saving a checkpoint at the end of this step") != 1:
        problems.append("the press was not acknowledged exactly once")
    return problems


@pytest.fixture(scope="module")
def ctrl_c_one_process(tmp_path_factory):
    """Ctrl-C to `accelerate launch` (one process; the worker gets the press and the launcher's copy) after step 2,
    with the default recipe's `save_strategy: "no"`; then the same command again, to the end."""
    out = tmp_path_factory.mktemp("ctrl_c1") / "out"
    args = recipe_args(out)  # no save_steps: the default recipe saves no checkpoints, Ctrl-C saves one anyway
    stop = signal_launcher(args, out, signal.SIGINT, after_step=2, launcher="accelerate", tag="int", group=True)
    resumed = launch(args, out, launcher="accelerate", tag="resume")
    return SimpleNamespace(out=out, stop=stop, resumed=resumed)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_under_accelerate_launch_saves_says_one_line_and_exits_130(ctrl_c_one_process):
    stop = ctrl_c_one_process.stop
    assert _interrupted_cleanly(stop, step=3, ranks=1) == [], stop["run"].tail()
    assert stop["status"]["signal"] == "SIGINT"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_rerun_ends_bitwise_where_an_uninterrupted_run_ends(ctrl_c_one_process):
    resumed = ctrl_c_one_process.resumed
    assert resumed.returncode == 0 and "resuming from" in resumed.output and "checkpoint-3" in resumed.output
    assert _same(load_adapter(ctrl_c_one_process.out), load_adapter(baseline_run().out)), resumed.tail()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_ctrl_c_under_accelerate_launch_two_processes(tmp_path):
    """Two ranks (torch elastic inside accelerate: the workers run in their own sessions, so the press reaches the
    launcher, which forwards it): both save the same step, exit 130, and the rerun ends where the reference ends."""
    out = tmp_path / "out"
    args = ddp_args(out)
    stop = signal_launcher(
        args,
        out,
        signal.SIGINT,
        after_step=1,
        nproc=2,
        launcher="accelerate",
        accelerate_config=CPU_2PROC,
        tag="int",
        group=True,
    )
    assert _interrupted_cleanly(stop, step=2, ranks=2) == [], stop["run"].tail()
    resumed = launch(args, out, nproc=2, accelerate_config=CPU_2PROC, launcher="accelerate", tag="resume")
    assert resumed.returncode == 0 and "checkpoint-2" in resumed.output, resumed.tail()
    assert _same(load_adapter(out), load_adapter(ddp_reference_run().out))
