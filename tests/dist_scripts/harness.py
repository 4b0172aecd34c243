"""Shared by the distributed / resume / precision tests: seconds-long recipe runs through `recipe_probe.py`.

Every run uses the same tiny embedded Llama base (built once per test session into a shared temp dir),
a small slice of the embedded dataset, `OMP_NUM_THREADS=1` (so a baseline and a resumed run do the same
float operations in the same order and can be compared bit for bit) and no evaluation before training, except the
sharded-engine runs (`engine_runs`), which keep the default recipe's evaluation before and after training.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "recipe_probe.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
ACCELERATE = Path(sys.executable).parent / "accelerate"
PROBE_INPUT_IDS = [[5, 17, 42, 8, 99, 3, 250, 61, 7, 130, 12, 77]]  # the probe's fixed input for in-memory logits


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.cache
def session_dir() -> Path:
    """A temp dir shared by every test of this session (base cache, data slices, baseline runs)."""
    path = Path(tempfile.mkdtemp(prefix="hf_stable_dist_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def data_files(n_train: int) -> tuple[Path, Path]:
    folder = session_dir() / f"data{n_train}"
    folder.mkdir(exist_ok=True)
    train = (ROOT / "data/embedded/train.jsonl").read_text(encoding="utf-8").splitlines()[:n_train]
    held = (ROOT / "data/embedded/eval.jsonl").read_text(encoding="utf-8").splitlines()[:16]
    (folder / "train.jsonl").write_text("\n".join(train) + "\n", encoding="utf-8")
    (folder / "eval.jsonl").write_text("\n".join(held) + "\n", encoding="utf-8")
    return folder / "train.jsonl", folder / "eval.jsonl"


def tiny_base_args(cache_dir: Path, pretrain_steps: int = 0) -> list[str]:
    """Recipe overrides for the tests' tiny embedded base (hidden 64, 2 layers, vocab 512), cached in `cache_dir`."""
    args = ["--model.embedded.hidden_size", "64", "--model.embedded.intermediate_size", "128"]
    args += ["--model.embedded.num_hidden_layers", "2", "--model.embedded.vocab_size", "512"]
    args += ["--model.embedded.pretrain_steps", str(pretrain_steps)]
    if pretrain_steps:
        args += ["--model.embedded.pretrain_batch_size", "8"]
    return [*args, "--model.embedded.cache_dir", str(cache_dir)]


def recipe_args(
    out: Path, *, steps: int = 8, n_train: int = 64, save_steps: int | None = None, evaluation: bool = False
) -> list[str]:
    """scripts/finetune.py arguments for a tiny run writing into `out` (`evaluation`: the default recipe's
    evaluation before and after training with exact match, on the 16 held-out records; else only eval loss after)."""
    train, held = data_files(n_train)
    quiet = [] if evaluation else ["--evaluation.before", "false", "--evaluation.exact_match_samples", "0"]
    args = [
        "--model.name_or_path",
        "embedded:tiny-llama",
        *tiny_base_args(session_dir() / "bases", pretrain_steps=20),
        "--data.train_file",
        str(train),
        "--data.eval_file",
        str(held),
        *quiet,
        "--training.max_steps",
        str(steps),
        "--training.logging_steps",
        "2",
        "--training.per_device_train_batch_size",
        "8",
        "--training.dataloader_num_workers",
        "0",
        "--training.output_dir",
        str(out),
    ]
    if save_steps:
        args += ["--training.save_strategy", "steps", "--training.save_steps", str(save_steps)]
    return args


class Run:
    """The outcome of one launch: exit code, output text, and helpers to read what it wrote."""

    def __init__(self, returncode: int, output: str, out: Path, probe: Path, stderr: str = ""):
        self.returncode, self.output, self.out, self.probe = returncode, output, out, probe
        self.stderr = stderr  # stderr alone (output holds stdout, then stderr)

    def tail(self, n: int = 6000) -> str:
        return self.output[-n:]

    def ranks(self) -> list[dict]:
        files = sorted(self.probe.glob("probe_rank*.json"))
        return [json.loads(f.read_text()) for f in files]

    def exit_codes(self) -> dict[int, int]:
        codes = {}
        for f in self.probe.glob("exit_rank*.json"):
            data = json.loads(f.read_text())
            codes[data["rank"]] = data["code"]
        return codes


def recipe_env(probe: Path, fault: str | None = None) -> dict:
    """The environment of a probed recipe run: offline, one thread (bitwise comparable), probe files in `probe`."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "HF_STABLE_PROBE_DIR": str(probe),
    }
    env.pop("HF_STABLE_FAULT", None)
    if fault:
        env["HF_STABLE_FAULT"] = fault
    return env


def start(
    args: list[str],
    out: Path,
    *,
    nproc: int = 1,
    fault: str | None = None,
    tag: str = "probe",
    accelerate_config: str | None = None,
    launcher: str | None = None,
) -> Launched:
    """Start the recipe (through the probe) without waiting: see `launch`."""
    probe = out.parent / f"{out.name}_{tag}"
    env = recipe_env(probe, fault)
    launcher = launcher or ("python" if nproc == 1 else "accelerate" if accelerate_config else "torchrun")
    if launcher == "python":
        cmd = [sys.executable, str(PROBE), *args]
    elif launcher == "accelerate" and accelerate_config:
        port = free_port()
        cmd = [str(ACCELERATE), "launch", "--config_file", str(ROOT / accelerate_config)]
        cmd += ["--num_processes", str(nproc), "--main_process_port", str(port), str(PROBE), *args]
    elif launcher == "accelerate":  # the README's one-process launch (`make demo`)
        cmd = [str(ACCELERATE), "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no"]
        cmd += ["--dynamo_backend", "no", str(PROBE), *args]
    else:
        cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), str(PROBE), *args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    return Launched(proc, cmd, out, probe)


class Launched:
    """A running launch: its launcher process (`proc`), and `wait` for the outcome."""

    def __init__(self, proc: subprocess.Popen, cmd: list[str], out: Path, probe: Path):
        self.proc, self.cmd, self.out, self.probe = proc, cmd, out, probe

    def wait_for_files(self, pattern: str, count: int, timeout: float) -> None:
        """Wait until `count` files matching `pattern` exist in the probe dir (e.g. every rank paused)."""
        deadline = time.monotonic() + timeout
        while len(list(self.probe.glob(pattern))) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.wait(timeout=30).output if self.proc.poll() is not None else ""
                self.kill()
                raise AssertionError(
                    f"no {count} x {pattern} in {self.probe} ({' '.join(self.cmd)}):\n{output[-6000:]}"
                )
            time.sleep(0.2)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: int = 240) -> Run:
        """Wait for the launcher; on timeout its whole process group is killed, so no rank outlives the test."""
        try:
            stdout, stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            stdout, stderr = self.proc.communicate()
            raise AssertionError(
                f"timed out after {timeout}s: {' '.join(self.cmd)}\n{(stdout + stderr)[-6000:]}"
            ) from None
        return Run(self.proc.returncode, stdout + stderr, self.out, self.probe, stderr=stderr)


def launch(
    args: list[str],
    out: Path,
    *,
    nproc: int = 1,
    fault: str | None = None,
    timeout: int = 240,
    tag: str = "probe",
    accelerate_config: str | None = None,
    launcher: str | None = None,
) -> Run:
    """Run the recipe (through the probe) in 1 process, or in `nproc` gloo ranks under torchrun (or under
    `accelerate launch --config_file accelerate_config` when given); `launcher="accelerate"` with one process
    runs it under `accelerate launch --num_processes 1`.

    On timeout the whole process group is killed, so no rank outlives the test.
    """
    return start(
        args, out, nproc=nproc, fault=fault, tag=tag, accelerate_config=accelerate_config, launcher=launcher
    ).wait(timeout)


def load_adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def strip_timing(state: dict) -> dict:
    """Callback states without what depends on wall-clock time or on where a process started.

    ThroughputMonitor's totals are timings (its step and token counts continue exactly over a resume, see
    tests/test_monitor_trainer.py); everything else must match exactly.
    """
    out = json.loads(json.dumps(state))
    out.get("ThroughputMonitor", {}).pop("totals", None)
    return out


def signal_launcher(
    args: list[str], out: Path, sig: int, *, after_step: int, nproc: int = 1, tag: str, group: bool = False, **kw
) -> dict:
    """Start a launch, wait until every rank ends step `after_step` (the probe's `pause:` fault holds it there),
    send `sig` to the launcher process only (as Kubernetes does; `group`: to its process group, as a terminal sends
    Ctrl-C), and wait for the launch to end.

    Returns:
        {"run": Run, "workers": worker pids, "seconds": from the signal to the end of the launch,
         "status": RUN_INCOMPLETE.json right after it (None when absent)}.
    """
    started = start(args, out, nproc=nproc, fault=f"pause:{after_step}", tag=tag, **kw)
    started.wait_for_files("paused_rank*", nproc, timeout=300)
    workers = [int(f.read_text()) for f in started.probe.glob("paused_rank*")]
    (os.killpg if group else os.kill)(started.proc.pid, sig)  # the launch runs in its own session: pgid = pid
    signalled = time.monotonic()
    run = started.wait(timeout=300)
    status = out / "RUN_INCOMPLETE.json"
    return {
        "run": run,
        "workers": workers,
        "seconds": time.monotonic() - signalled,
        "status": json.loads(status.read_text()) if status.is_file() else None,
    }


CPU = ["--training.use_cpu", "true"]  # without it TrainingArguments runs each CPU process alone (see prepare_launch)
# thresholds inside the tiny run's gradient-norm range, so a guard skips steps and a monitor alerts: decisions
# that must come out the same on both ranks (they read all-reduced values)
DECISIONS = ["--stability.guards.skip.grad_norm_max", "1.2", "--stability.monitors.grad.explosion_norm", "1.1"]


def ddp_args(out: Path) -> list[str]:
    """The two-rank run: 96 rows / (2 ranks x 8) = 6 steps = 1 epoch."""
    return recipe_args(out, steps=6, n_train=96) + CPU + DECISIONS


@functools.cache
def ddp_reference_run() -> Run:
    """The uninterrupted two-rank reference (`ddp_args`, torchrun), shared by the tests that preempt it."""
    out = session_dir() / "ddp_reference" / "out"
    out.parent.mkdir(parents=True, exist_ok=True)
    run = launch(ddp_args(out), out, nproc=2)
    assert run.returncode == 0, run.tail()
    return run


@functools.cache
def baseline_run() -> Run:
    """The uninterrupted reference run (8 steps, checkpoints every 2 steps), shared by several test modules."""
    out = session_dir() / "baseline" / "out"
    out.parent.mkdir(parents=True, exist_ok=True)
    run = launch(recipe_args(out, save_steps=2), out)
    assert run.returncode == 0, run.tail()
    return run


# The sharded engines as the README launches them: DeepSpeed through TrainingArguments (torchrun), FSDP2 through
# `accelerate launch --config_file configs/accelerate/fsdp2.yaml` (2 processes). FSDP2 on CPU needs the test-only
# accelerate patch in fsdp_cpu.py, which recipe_probe.py applies when the launch asks for FSDP.
ENGINES = {
    "zero2": (["--training.deepspeed", "configs/deepspeed/zero2.json"], None),
    "zero3": (["--training.deepspeed", "configs/deepspeed/zero3.json"], None),
    "fsdp2": ([], "configs/accelerate/fsdp2.yaml"),
}
PREEMPTED_ENGINES = ("zero3", "fsdp2")  # SIGTERM after step 2 (checkpoint-3, exit 143), then the rerun resumes


@functools.cache
def engine_runs(engine: str) -> tuple[Run, ...]:
    """The default recipe (evaluation before and after training, exact match) for 4 steps on 2 CPU ranks under
    `engine`, checkpointing every 2 steps; shared by every test that reads it. One uninterrupted launch, or for
    `PREEMPTED_ENGINES` the preempted launch (rank 0 alone sends itself SIGTERM at the end of step 2) and the rerun
    that resumes from its checkpoint-3."""
    out = session_dir() / f"engine_{engine}" / "out"
    out.parent.mkdir(parents=True, exist_ok=True)
    extra, accelerate_config = ENGINES[engine]
    args = recipe_args(out, steps=4, save_steps=2, evaluation=True) + CPU + extra
    kw = {"nproc": 2, "timeout": 480, "accelerate_config": accelerate_config}
    if engine not in PREEMPTED_ENGINES:
        return (launch(args, out, **kw),)
    first = launch(args, out, fault="sigterm:2:0", tag="first", **kw)
    return first, launch(args, out, tag="second", **kw)


def torchrun_two_ranks(script: Path, *args: str, timeout: int, env: dict | None = None) -> str:
    """Run `script` on 2 gloo ranks with `torchrun --standalone`; return stderr, or fail the test on a hang/error.

    The whole process group is killed on timeout so no rank outlives the test (a hung collective never returns).
    """
    import pytest

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(script), *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"2-rank run of {script.name} timed out (a rank hung in a collective?):\n{stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    return stderr
