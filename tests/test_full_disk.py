"""A real full disk: a small tmpfs mounted in a private mount namespace (`unshare -m`, root only), no fault injection.

torch's zip writer reports a full disk as `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos
N vs M` (no errno, no word of the disk): the recipe must still say "the disk is full" in one line, mark the run
failed with that, and a rerun after freeing space must resume from the last complete checkpoint. The writer fault
of tests/test_resume.py (ENOSPC, safetensors' StorageFull text) covers what a real disk does not produce here.
Where the namespace or the mount is refused (not root, no CAP_SYS_ADMIN, not Linux), these tests skip, saying why.
"""

from __future__ import annotations

import functools
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hf_stable.checkpoints import checkpoint_problems, latest_complete_checkpoint
from tests.dist_scripts.harness import PROBE, ROOT, baseline_run, load_adapter, recipe_args, recipe_env

DRIVER = Path(__file__).resolve().parent / "dist_scripts" / "small_disk.py"


@functools.cache
def _no_small_disk() -> str | None:
    """Why a tmpfs cannot be mounted in a private mount namespace here (None: it can)."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return "needs Linux with util-linux's unshare"
    with tempfile.TemporaryDirectory() as where:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(where)}"],
            capture_output=True,
            text=True,
            check=False,
        )
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace (needs root): {probe.stderr.strip()[:200]}"
    return None


def in_small_disk(disk: Path, size: str, script: str, *, env: dict | None = None, timeout: int) -> str:
    """Run the shell `script` in a new mount namespace where a `size` tmpfs is mounted on `disk` (gone afterwards:
    the script copies out what the test reads). Returns the script's stderr."""
    reason = _no_small_disk()
    if reason:
        pytest.skip(reason)
    disk.mkdir(parents=True, exist_ok=True)
    mount = f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(disk))} || exit 97"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{mount}\n{script}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stderr


# ---- which failures are a full disk (a roomy disk, no root needed) ---------------------------------------------


def test_a_failed_save_is_a_full_disk_only_when_the_disk_is_nearly_full(tmp_path):
    from hf_stable.full_disk import disk_full, nearly_full, raised_while_saving

    try:
        torch.save(torch.zeros(4), tmp_path / "no such folder" / "x.pt")  # a real save failure on a roomy disk
    except RuntimeError as e:
        failed_save = e
    try:
        int("not a number")
    except ValueError as e:
        bug = e
    assert raised_while_saving(failed_save) and not raised_while_saving(bug)
    assert not disk_full(bug, tmp_path)  # however full the disk
    assert disk_full(failed_save, tmp_path) is nearly_full(tmp_path)  # a roomy disk: a failed save is no full disk


# ---- a real full disk -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_save_on_a_real_full_disk_is_reported_as_a_full_disk_and_a_bug_is_not(tmp_path):
    report = tmp_path / "report.json"
    disk = tmp_path / "disk"
    script = f"{shlex.quote(sys.executable)} {shlex.quote(str(DRIVER))} {shlex.quote(str(disk))} {report}"
    in_small_disk(disk, "256k", script, timeout=240)
    cases = json.loads(report.read_text())

    save = cases["save"]
    assert save["exit"] == 1, save
    (line,) = save["stderr"].splitlines()  # one line, no traceback
    assert line.startswith("error: the disk is full (RuntimeError: ") and f"under {disk / 'run'}" in line, line
    assert " free under " in line and "rerun the same command: it starts from the beginning" in line
    assert save["status"]["status"] == "failed" and save["status"]["reason"] == "disk full"
    assert save["status"]["error"].startswith("the disk is full (RuntimeError: ")

    bug = cases["bug"]  # the same full disk, an error outside any save: a bug, re-raised with its traceback
    assert bug["exit"] == "raised" and bug["raised"] == "ValueError: a bug, not the disk"
    assert "disk is full" not in bug["stderr"]
    assert bug["status"]["status"] == "failed" and bug["status"]["error"] == "ValueError: a bug, not the disk"
    assert "reason" not in bug["status"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recipe_filling_a_real_disk_during_a_checkpoint_then_a_rerun_with_room_resumes_bitwise(tmp_path):
    """800 KiB: checkpoint-2 (~500 KiB) fits, checkpoint-4 fills the disk while torch writes its optimizer.pt."""
    base = baseline_run()
    disk, logs = tmp_path / "disk", tmp_path / "logs"
    logs.mkdir()
    out = disk / "out"
    cmd = shlex.join([sys.executable, str(PROBE), *recipe_args(out, save_steps=2)])
    q = shlex.quote
    script = "\n".join(
        [
            f"{cmd} > {q(str(logs / 'full.out'))} 2> {q(str(logs / 'full.err'))}; echo $? > {q(str(logs / 'full.rc'))}",
            f"cp -a {q(str(out))} {q(str(logs / 'after_full'))}",
            f"mount -o remount,size=64m {q(str(disk))} || exit 98",  # space freed
            f"{cmd} > {q(str(logs / 'rerun.out'))} 2> {q(str(logs / 'rerun.err'))}; echo $? > {q(str(logs / 'rerun.rc'))}",
            f"cp -a {q(str(out))} {q(str(logs / 'after_rerun'))}",
        ]
    )
    in_small_disk(disk, "800k", script, env=recipe_env(logs / "probe"), timeout=540)
    full_err = (logs / "full.err").read_text()
    assert (logs / "full.rc").read_text().strip() == "1", full_err[-4000:]
    assert "Traceback" not in full_err and "During handling" not in full_err, full_err[-4000:]
    (error,) = [line for line in full_err.splitlines() if line.startswith("error:")]
    assert error.startswith("error: the disk is full (RuntimeError: "), error  # torch's writer: no errno
    assert f"under {out}" in error and "it resumes from checkpoint-2" in error, error
    status = json.loads((logs / "after_full" / "RUN_INCOMPLETE.json").read_text())
    assert status["status"] == "failed" and status["reason"] == "disk full"
    assert status["error"].startswith("the disk is full (RuntimeError: ")
    assert latest_complete_checkpoint(logs / "after_full") == logs / "after_full" / "checkpoint-2"
    assert checkpoint_problems(logs / "after_full" / "checkpoint-4")  # half-written, never resumed from

    rerun = (logs / "rerun.out").read_text() + (logs / "rerun.err").read_text()
    assert (logs / "rerun.rc").read_text().strip() == "0", rerun[-4000:]
    assert "resuming from" in rerun and "checkpoint-2" in rerun
    after = load_adapter(logs / "after_rerun")
    reference = load_adapter(base.out)
    assert after.keys() == reference.keys() and all(torch.equal(after[k], reference[k]) for k in after)
    assert (logs / "after_rerun" / "run_summary.json").is_file()
    # evaluation.exact_match_samples 0 (recipe_args): the log says it is off, not "None on 0 prompts None"
    assert "after: eval loss " in rerun and "exact match: off" in rerun and "exact match None" not in rerun
