"""One message per job: with several ranks an error every rank has (the config, the data) is printed by rank 0
alone; a rank's own failure (its disk, its snapshot file) by that rank, naming it (`error: rank 1: ...`)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from hf_stable import outputs
from hf_stable.core.snapshot import SnapshotError
from hf_stable.errors import ConfigError
from hf_stable.outputs import error_boundary
from tests.dist_scripts.harness import CPU, launch, recipe_args


def _stopped(capsys, error: BaseException) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop, error_boundary():
        raise error
    return stop.value.code, capsys.readouterr().err


def _signal_once_handled(signum: int) -> threading.Thread:
    """Send `signum` to this process once a handler of ours replaced the current one (as torch elastic stops the
    other ranks when rank 0 has exited)."""
    original = signal.getsignal(signum)

    def send():
        deadline = time.monotonic() + 10
        while signal.getsignal(signum) is original and time.monotonic() < deadline:
            time.sleep(0.01)
        if signal.getsignal(signum) is not original:  # never the default action on the test process
            os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_rank_zero_prints_what_every_rank_has_and_each_rank_its_own_failure(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, err = _stopped(capsys, ConfigError("lora.r: got 0, must be >= 1"))
    assert code == 2 and err.startswith("error: 1 configuration problem(s):") and "rank" not in err

    monkeypatch.setenv("RANK", "1")
    code, err = _stopped(capsys, SnapshotError("rollback snapshot /x/rank1.pt cannot be read"))
    assert code == 2 and err == "error: rank 1: rollback snapshot /x/rank1.pt cannot be read\n"

    # the shared error on rank 1: silent until the launcher stops it (rank 0 has printed it and exited) ...
    monkeypatch.setattr(outputs, "FOLLOWER_WAIT_SECONDS", 30.0)
    sender = _signal_once_handled(signal.SIGTERM)
    started = time.monotonic()
    code, err = _stopped(capsys, ConfigError("lora.r: got 0, must be >= 1"))
    sender.join()
    assert code == 2 and err == "" and time.monotonic() - started < 15
    # ... and if nothing stops it, rank 0 did not stop the same way: rank 1 says it, naming itself
    monkeypatch.setattr(outputs, "FOLLOWER_WAIT_SECONDS", 0.05)
    code, err = _stopped(capsys, ConfigError("lora.r: got 0, must be >= 1"))
    assert code == 2 and err.startswith("error: rank 1: 1 configuration problem(s):")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_print_a_bad_config_once(tmp_path):
    out = tmp_path / "out"
    run = launch(recipe_args(out) + CPU + ["--lora.r", "0"], out, nproc=2)
    assert run.returncode == 2, run.tail()
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: 1 configuration problem(s)"), run.tail()
    assert run.stderr.count("lora.r: got 0, must be > 0") == 1, run.tail()
    assert "Traceback" not in run.stderr, run.tail()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_full_disk_on_one_rank_is_printed_by_that_rank_naming_it(tmp_path):
    out = tmp_path / "out"
    args = recipe_args(out, steps=6, n_train=96, save_steps=2) + CPU
    run = launch(args, out, nproc=2, fault="enospc:4:1")  # rank 1's writes fail from checkpoint-4 on
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: the disk is full (OSError: "), run.tail()
    assert "rng_state_1.pth" in errors[0] and "it resumes from checkpoint-2" in errors[0]
    assert run.exit_codes().get(1) == 1, run.exit_codes()
    # rank 0 lost rank 1 in the checkpoint's barrier: one line of its own, not gloo's traceback
    assert "[rank0]: Traceback" not in run.stderr and "[rank0]: RuntimeError" not in run.stderr, run.tail()


def test_a_rank_that_lost_another_rank_in_a_collective_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    from hf_stable.outputs import INCOMPLETE_FILE, OutputDir

    out = OutputDir(tmp_path / "run").start({})
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6062"
    )
    with pytest.raises(RuntimeError), error_boundary(out):  # one process: no other rank, a bug like any other
        raise gloo
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop, error_boundary(out):
        raise gloo
    (line,) = capsys.readouterr().err.splitlines()
    assert stop.value.code == 1 and line.startswith("hf_stable: rank 0 stopped: another rank left a collective")
    status = json.loads((out.path / INCOMPLETE_FILE).read_text())
    assert status["reason"] == "another rank stopped" and "Connection closed by peer" in status["error"]
