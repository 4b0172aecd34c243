"""Fault tolerance: kill -9 mid-save, SIGTERM preemption, and which checkpoint a restart resumes from.

The end-to-end tests run scripts/finetune.py (through tests/dist_scripts/recipe_probe.py, which can kill the
process at a chosen point) and compare the resumed run's final adapter with an uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_stable.checkpoints import (
    MARKER_FILE,
    SUPERSEDED_FILE,
    checkpoint_problems,
    latest_complete_checkpoint,
    mark_complete,
    resolve_resume,
)
from hf_stable.errors import ConfigError
from tests.dist_scripts.harness import baseline_run, launch, load_adapter, recipe_args, strip_timing

# ---- checkpoint completeness (no training) ------------------------------------------------------------


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"x" * 100)
    (folder / "optimizer.pt").write_bytes(b"y" * 50)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if complete:
        mark_complete(folder, step)
    return folder


def test_latest_complete_checkpoint_skips_every_kind_of_incomplete(tmp_path):
    good = _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4, complete=False)  # killed before the marker
    truncated = _fake_checkpoint(tmp_path, 6)
    (truncated / "optimizer.pt").write_bytes(b"y" * 10)  # a file cut short after marking
    missing = _fake_checkpoint(tmp_path, 8)
    (missing / "trainer_state.json").unlink()
    moved = _fake_checkpoint(tmp_path, 10)
    (moved / MARKER_FILE).replace(tmp_path / "stray.json")
    (moved / MARKER_FILE).write_text((good / MARKER_FILE).read_text())  # marker of another step

    assert latest_complete_checkpoint(tmp_path) == good
    assert checkpoint_problems(good) == []
    assert "no hf_stable_complete.json" in checkpoint_problems(tmp_path / "checkpoint-4")[0]
    assert "optimizer.pt has 10 bytes, 50" in " ".join(checkpoint_problems(truncated))
    assert "trainer_state.json is listed" in " ".join(checkpoint_problems(missing))
    assert "says step 2" in " ".join(checkpoint_problems(moved))
    assert latest_complete_checkpoint(tmp_path / "nothing_here") is None


def _args(out: Path, explicit: str | None = None):
    return SimpleNamespace(output_dir=str(out), resume_from_checkpoint=explicit)


def test_resolve_resume_auto_never_and_explicit(tmp_path):
    assert resolve_resume("auto", _args(tmp_path)) is None  # nothing to resume: start fresh
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 6, complete=False)
    assert resolve_resume("auto", _args(tmp_path)) == str(tmp_path / "checkpoint-4")

    # an explicit older checkpoint retires the newer ones, so a later `auto` cannot jump back to them
    assert resolve_resume("checkpoint-2", _args(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-4" / SUPERSEDED_FILE).is_file()
    assert resolve_resume("auto", _args(tmp_path)) == str(tmp_path / "checkpoint-2")

    with pytest.raises(ConfigError, match=r"runtime.resume: cannot resume from .*checkpoint-6.*no hf_stable_complete"):
        resolve_resume(str(tmp_path / "checkpoint-6"), _args(tmp_path))
    with pytest.raises(ConfigError, match="training.resume_from_checkpoint: cannot resume from 'missing'"):
        resolve_resume("auto", _args(tmp_path, explicit="missing"))
    with pytest.raises(ConfigError, match="set only one"):
        resolve_resume("checkpoint-2", _args(tmp_path, explicit=str(tmp_path / "checkpoint-4")))

    assert resolve_resume("never", _args(tmp_path)) is None  # a fresh start retires every checkpoint
    assert latest_complete_checkpoint(tmp_path) is None


def test_preemption_callback_restores_handlers_and_state():
    from hf_stable.callbacks.preemption_callback import PreemptionCallback

    with pytest.raises(ValueError, match="SIGNOPE"):
        PreemptionCallback(signals=["SIGNOPE"])
    cb = PreemptionCallback(signals=["SIGUSR1"])
    before = signal.getsignal(signal.SIGUSR1)
    cb._install()
    assert signal.getsignal(signal.SIGUSR1) == cb._handle
    signal.raise_signal(signal.SIGUSR1)  # the handler only records it; the step boundary acts on it
    assert cb._received == signal.SIGUSR1
    cb._restore()
    assert signal.getsignal(signal.SIGUSR1) == before
    fresh = PreemptionCallback()
    fresh.load_state_dict({"preemptions": 2})
    assert fresh.state_dict() == {"preemptions": 2}


def test_a_signal_outside_a_training_step_marks_the_run_preempted(tmp_path, capsys, monkeypatch):
    from hf_stable.callbacks import preemption_callback
    from hf_stable.callbacks.preemption_callback import PreemptionCallback, stop_on_signals
    from hf_stable.config.runtime import PreemptionConfig
    from hf_stable.outputs import INCOMPLETE_FILE, OutputDir, error_boundary

    # each raise_signal below is a new request, not a copy of the one before (those arrive within milliseconds)
    monkeypatch.setattr(preemption_callback, "DUPLICATE_SECONDS", 0.0)
    with stop_on_signals(PreemptionConfig(enabled=False)) as handled:
        assert handled == []
    out = OutputDir(tmp_path / "run").start({})
    before = signal.getsignal(signal.SIGUSR1)
    signals = PreemptionConfig(signals=["SIGUSR1"], exit_code=140)
    with pytest.raises(SystemExit) as stop, error_boundary(out), stop_on_signals(signals) as handled:
        assert handled == ["SIGUSR1"]
        child = multiprocessing.get_context("fork").Process(target=signal.raise_signal, args=(signal.SIGUSR1,))
        child.start()  # a forked child (a DataLoader worker) keeps the default action: it dies of the signal
        child.join(30)
        assert child.exitcode == -signal.SIGUSR1
        during = PreemptionCallback(signals=["SIGUSR1"])  # training: the callback takes the signal over ...
        during._install()
        signal.raise_signal(signal.SIGUSR1)
        assert during.pending
        during._restore()  # ... and gives it back when training ends
        signal.raise_signal(signal.SIGUSR1)
        pytest.fail("the signal did not stop the run")
    assert signal.getsignal(signal.SIGUSR1) == before  # the block's end put the previous handler back
    assert stop.value.code == 140
    status = json.loads((out.path / INCOMPLETE_FILE).read_text())
    assert status["status"] == "preempted" and status["signal"] == "SIGUSR1" and status["checkpoint"] is None
    assert "preempted: SIGUSR1 received outside a training step, nothing to save" in capsys.readouterr().out

    # in training, a second signal later than DUPLICATE_SECONDS: the callback gives up, the run stops at once
    monkeypatch.setattr(preemption_callback, "DUPLICATE_SECONDS", 0.0)
    with pytest.raises(SystemExit) as stop, error_boundary(out), stop_on_signals(signals):
        during = PreemptionCallback(signals=["SIGUSR1"])
        during._install()
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)
        pytest.fail("the second signal did not stop the run")
    assert stop.value.code == 140 and json.loads((out.path / INCOMPLETE_FILE).read_text())["status"] == "preempted"
    assert signal.getsignal(signal.SIGUSR1) == before

    capsys.readouterr()
    out.finish({"train_steps": 0})  # a finished run stays finished, whatever arrives during its last line
    with pytest.raises(SystemExit), error_boundary(out), stop_on_signals(signals):
        signal.raise_signal(signal.SIGUSR1)
    assert (out.path / "run_summary.json").is_file() and not (out.path / INCOMPLETE_FILE).exists()
    assert "preempted" not in capsys.readouterr().out


def test_ctrl_c_is_acknowledged_deduplicated_and_a_second_press_stops_at_once(tmp_path, capfd, monkeypatch):
    """Ctrl-C is a preemption: the first press is acknowledged once (its copy from the launcher is the same press),
    and a press after that stops the run at once, marked "interrupted", exit 130, one line and no traceback."""
    from hf_stable.callbacks import preemption_callback
    from hf_stable.callbacks.preemption_callback import PreemptionCallback, stop_on_signals
    from hf_stable.config.runtime import PreemptionConfig
    from hf_stable.outputs import INCOMPLETE_FILE, OutputDir, error_boundary

    assert PreemptionConfig().signals == ["SIGTERM", "SIGINT"]  # Ctrl-C among the defaults
    out = OutputDir(tmp_path / "run").start({})
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stop, error_boundary(out), stop_on_signals(PreemptionConfig(), out):
        during = PreemptionCallback()
        during._install()
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the same press again (terminal + launcher): no KeyboardInterrupt
        assert during.pending and signal.getsignal(signal.SIGINT) == during._handle
        ack = capfd.readouterr().out
        assert ack.count("Ctrl-C: saving a checkpoint at the end of this step") == 1, ack
        monkeypatch.setattr(preemption_callback, "DUPLICATE_SECONDS_INTERACTIVE", 0.0)  # the person presses again
        signal.raise_signal(signal.SIGINT)
        pytest.fail("the second press did not stop the run")
    assert stop.value.code == 130 and signal.getsignal(signal.SIGINT) == before
    status = json.loads((out.path / INCOMPLETE_FILE).read_text())
    assert status["status"] == "interrupted" and status["signal"] == "SIGINT", status
    captured = capfd.readouterr()
    lines = [line for line in captured.out.splitlines() if line.strip()]
    expected = "interrupted: a second Ctrl-C stopped it at once, nothing saved; rerun the same command: it starts "
    assert lines == [expected + "from the beginning (no complete checkpoint)"], captured
    assert "Traceback" not in captured.err and "KeyboardInterrupt" not in captured.err

    # outside a training step (loading, evaluating) Ctrl-C stops at once too: "interrupted", 130
    monkeypatch.setattr(preemption_callback, "DUPLICATE_SECONDS_INTERACTIVE", 0.0)
    with pytest.raises(SystemExit) as stop, error_boundary(out), stop_on_signals(PreemptionConfig(), out):
        signal.raise_signal(signal.SIGINT)
    assert stop.value.code == 130 and json.loads((out.path / INCOMPLETE_FILE).read_text())["status"] == "interrupted"
    assert "interrupted: SIGINT received outside a training step, nothing to save" in capfd.readouterr().out

    # before any handler exists (loading the config, building the base): a KeyboardInterrupt, said the same way
    try:
        with pytest.raises(SystemExit) as stop, error_boundary(out):
            raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, before)
    assert stop.value.code == 130 and json.loads((out.path / INCOMPLETE_FILE).read_text())["status"] == "interrupted"
    captured = capfd.readouterr()
    assert "interrupted: Ctrl-C before training, nothing to save" in captured.out and "Traceback" not in captured.err


_BLOCKED = """
import ctypes, os, signal, sys, threading
from hf_stable.callbacks import preemption_callback
from hf_stable.config.runtime import PreemptionConfig
from hf_stable.outputs import OutputDir, error_boundary

preemption_callback.STUCK_SECONDS = 1.0
out = OutputDir(sys.argv[1]).start({})
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
with error_boundary(out), preemption_callback.stop_on_signals(PreemptionConfig(), out):
    ctypes.CDLL(None).system(b"exec sleep 30 >/dev/null 2>&1")  # blocked in C, like a collective missing a rank
print("not stopped")
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_signal_while_blocked_in_a_c_call_still_ends_the_run_marked_preempted(tmp_path):
    import subprocess
    import sys
    import time

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 143, done.stdout + done.stderr[-3000:]
    assert time.monotonic() - started < 25 and "not stopped" not in done.stdout  # not after the 30 s C call
    status = json.loads((tmp_path / "run" / "RUN_INCOMPLETE.json").read_text())
    assert status["status"] == "preempted" and status["signal"] == "SIGTERM" and "blocked" in status["note"]
    assert "preempted: SIGTERM received while blocked in a C call" in done.stdout


# ---- end to end: scripts/finetune.py killed and resumed -------------------------------------------------


def _assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:3]}"


def _state(out: Path) -> dict:
    return json.loads((out / "trainer_state.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill9_while_saving_then_resume_equals_uninterrupted_run(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    base = baseline_run()
    out = tmp_path / "out"
    args = recipe_args(out, save_steps=2)

    killed = launch(args, out, fault="kill_in_save:6")
    assert killed.returncode == -signal.SIGKILL, killed.tail()
    half = out / "checkpoint-6"
    assert (half / "adapter_model.safetensors").is_file() and not (half / "trainer_state.json").exists()
    # transformers would resume from the half-written folder; hf_stable skips it
    assert Path(get_last_checkpoint(str(out))) == half
    assert latest_complete_checkpoint(out) == out / "checkpoint-4"
    assert not (out / "run_summary.json").exists()

    resumed = launch(args, out, tag="resume")  # the same command again: runtime.resume defaults to auto
    assert resumed.returncode == 0, resumed.tail()
    assert "resuming from" in resumed.output and "checkpoint-4" in resumed.output
    # evaluation.exact_match_samples 0 and no evaluation before training (recipe_args): said so, not "None"
    assert "after: eval loss " in resumed.output and ", exact match: off" in resumed.output
    assert "(not measured before), exact match: off" in resumed.output
    assert "exact match None" not in resumed.output and "eval loss None" not in resumed.output
    _assert_same_adapter(load_adapter(out), load_adapter(base.out))
    a, b = _state(out), _state(base.out)
    assert [h.get("loss") for h in a["log_history"]] == [h.get("loss") for h in b["log_history"]]
    assert a["global_step"] == b["global_step"] == 8
    # every hf_stable callback's state after resuming equals the uninterrupted run's (wall-clock timings aside)
    assert strip_timing(a["stateful_callbacks"]["hf_stable"]) == strip_timing(b["stateful_callbacks"]["hf_stable"])
    assert checkpoint_problems(half) == []  # re-written and marked by the resumed run
    assert (out / "run_summary.json").is_file() and not (out / "RUN_INCOMPLETE.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_saves_a_checkpoint_stops_and_resumes_to_the_same_adapter(tmp_path):
    base = baseline_run()
    out = tmp_path / "out"
    args = recipe_args(out, save_steps=2)

    stopped = launch(args, out, fault="sigterm:4")  # signal during step 4's hooks -> acted on at the end of step 5
    assert stopped.returncode == 143, stopped.tail()
    assert checkpoint_problems(out / "checkpoint-5") == []  # 5 is not a save step: the preemption saved it
    status = json.loads((out / "RUN_INCOMPLETE.json").read_text())
    assert status["status"] == "preempted" and status["step"] == 5
    for name in ("run_summary.json", "README.md", "adapter_model.safetensors"):
        assert not (out / name).exists(), f"a preempted run must not look finished ({name})"
    events = [json.loads(line) for line in (out / "stability_events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["source"]) for e in events if e["kind"] == "preemption"] == [(5, "PreemptionCallback")]

    resumed = launch(args, out, tag="resume")
    assert resumed.returncode == 0, resumed.tail()
    _assert_same_adapter(load_adapter(out), load_adapter(base.out))
    saved = _state(out)["stateful_callbacks"]["hf_stable"]
    assert saved["PreemptionCallback"] == {"preemptions": 1}  # restored from checkpoint-5, not reset
    assert (out / "run_summary.json").is_file() and not (out / "RUN_INCOMPLETE.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_before_training_starts_marks_the_run_preempted(tmp_path):
    out = tmp_path / "out"
    stopped = launch(recipe_args(out, save_steps=2), out, fault="sigterm_at_init")  # as the Trainer is built
    assert stopped.returncode == 143, stopped.tail()
    assert "Traceback" not in stopped.stderr and "error:" not in stopped.stderr, stopped.tail()
    assert "preempted: SIGTERM received outside a training step, nothing to save" in stopped.output
    assert "it starts from the beginning" in stopped.output
    status = json.loads((out / "RUN_INCOMPLETE.json").read_text())
    assert status["status"] == "preempted" and status["signal"] == "SIGTERM" and status["checkpoint"] is None
    assert not (out / "run_summary.json").exists() and not list(out.glob("checkpoint-*"))


def test_a_fresh_run_sets_an_earlier_runs_events_aside_and_a_resume_keeps_them(tmp_path):
    from hf_stable.core.events import EVENTS_FILE, read_events, write_event
    from hf_stable.outputs import OutputDir

    write_event(str(tmp_path), step=7, kind="step_skipped", message="from the earlier run", source="test")
    out = OutputDir(tmp_path)
    assert out.set_aside_events(resuming=True) is None  # a resume continues the same run's events
    assert [e["step"] for e in read_events(tmp_path)] == [7]
    moved = out.set_aside_events(resuming=False)
    assert moved is not None and moved.parent == tmp_path and moved.name != EVENTS_FILE
    assert read_events(tmp_path) == [] and "from the earlier run" in moved.read_text()  # set aside, not lost
    write_event(str(tmp_path), step=1, kind="rollback", message="a second earlier run", source="test")
    second = out.set_aside_events(resuming=False)  # same second: never overwrites the first
    assert second != moved and moved.is_file() and second.is_file()
    assert out.set_aside_events(resuming=False) is None  # nothing left to move


# ---- a full disk: the original error first, the run marked failed, no litter, the last complete checkpoint kept ----


def _litter(out: Path) -> list[str]:
    return [str(p) for p in out.rglob("*.tmp")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_disk_full_during_a_checkpoint_then_rerun_resumes_from_the_last_complete_one(tmp_path):
    base = baseline_run()
    out = tmp_path / "out"
    args = recipe_args(out, save_steps=2)

    full = launch(args, out, fault="enospc:4")  # checkpoint-2 saved; the disk fills up as checkpoint-4 starts
    assert full.returncode == 1, full.tail()
    assert "Traceback" not in full.stderr and "During handling" not in full.stderr
    errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "it resumes from checkpoint-2" in errors[0]
    assert errors[0] in full.stderr.split("not resuming from")[0]  # reported first, before anything about it
    status = json.loads((out / "RUN_INCOMPLETE.json").read_text())  # written in place: the disk had no room
    assert status["status"] == "failed" and "No space left on device" in status["error"]
    assert _litter(out) == [] and not (out / "run_summary.json").exists()
    assert latest_complete_checkpoint(out) == out / "checkpoint-2"  # the half-written checkpoint-4 is skipped

    resumed = launch(args, out, tag="resume")
    assert resumed.returncode == 0, resumed.tail()
    assert "resuming from" in resumed.output and "checkpoint-2" in resumed.output
    _assert_same_adapter(load_adapter(out), load_adapter(base.out))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_disk_full_during_the_final_save(tmp_path):
    out = tmp_path / "out"
    full = launch(recipe_args(out, save_steps=2), out, fault="enospc:final")
    assert full.returncode == 1, full.tail()
    assert "Traceback" not in full.stderr
    (error,) = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert "No space left on device" in error and "it resumes from checkpoint-8" in error
    assert json.loads((out / "RUN_INCOMPLETE.json").read_text())["status"] == "failed"
    assert _litter(out) == [] and not (out / "run_summary.json").exists()
    assert latest_complete_checkpoint(out) == out / "checkpoint-8"


def test_output_dir_writes_leave_no_temporary_file_and_failures_are_recorded_in_place(tmp_path, monkeypatch):
    import errno
    import io

    from hf_stable.outputs import INCOMPLETE_FILE, OutputDir, disk_full, error_boundary

    out = OutputDir(tmp_path / "run").start({"lora": {"r": 4}})
    real_open = io.open

    def full_disk(file, mode="r", *args, **kwargs):  # new data cannot be written; in-place overwrites can
        if any(c in mode for c in "wax"):
            real_open(file, mode, *args, **kwargs).close()
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", full_disk)
    monkeypatch.setattr("builtins.open", full_disk)
    with pytest.raises(OSError, match="No space left"):
        out.write_json("optimizer_groups.json", [])
    assert _litter(out.path) == [] and not (out.path / "optimizer_groups.json").exists()

    failure = RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, .. })")
    assert disk_full(failure) and not disk_full(RuntimeError("shape mismatch"))
    with pytest.raises(SystemExit) as stop, error_boundary(out):
        raise failure
    assert stop.value.code == 1
    monkeypatch.undo()
    assert json.loads((out.path / INCOMPLETE_FILE).read_text())["status"] == "failed"

    def nothing_writable(file, mode="r", *args, **kwargs):
        if mode != "r" and mode != "rb":
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", nothing_writable)
    monkeypatch.setattr("builtins.open", nothing_writable)
    note = out.fail(ValueError("x"))  # never raises: says why the failure could not be recorded
    assert note is not None and "EROFS" in note and INCOMPLETE_FILE in note
