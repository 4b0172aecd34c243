"""The README's launch prints hf_stable's lines only: other libraries' notices that are wrong for the run are gone
(`hf_stable/first_screen.py`, accelerate's defaults block in `hf_stable/launcher.py`), and only under their condition."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from hf_stable.config import load_config
from hf_stable.first_screen import has_accelerator, quiet_first_screen
from hf_stable.launcher import PlainLaunchDefaults
from tests.dist_scripts.harness import ACCELERATE, session_dir, tiny_base_args

ROOT = Path(__file__).resolve().parents[1]
HEAD = "The following values were not passed to `accelerate launch` and had defaults used instead:\n"
TAIL = "\nTo avoid this warning pass in values for each of the problematic parameters or run `accelerate config`."


def _kept(message: str) -> bool:
    record = logging.LogRecord("accelerate.commands.launch", logging.WARNING, "launch.py", 1, message, None, None)
    return PlainLaunchDefaults().filter(record)


def test_accelerate_defaults_block_is_dropped_only_for_the_plain_one_process_values():
    plain = ["\t`--num_processes` was set to a value of `0`", "\t`--num_machines` was set to a value of `1`"]
    plain += [
        "\t`--mixed_precision` was set to a value of `'no'`",
        "\t`--dynamo_backend` was set to a value of `'no'`",
    ]
    assert not _kept(HEAD + "\n".join(plain) + TAIL)
    eight = ["\t`--num_processes` was set to a value of `8`", *plain[1:]]
    gpus = [*plain, "\t\tMore than one GPU was found, enabling multi-GPU training."]
    threads = [*plain, "\t`--num_cpu_threads_per_process` was set to `8` to improve out-of-box performance"]
    for lines in (eight, gpus, threads):  # a value the user did not choose and may not want: said
        assert _kept(HEAD + "\n".join(lines) + TAIL), lines
    assert _kept("some other accelerate warning")


def test_deepspeed_is_told_the_cpu_only_where_it_would_pick_it_itself():
    cfg = load_config()
    env: dict[str, str] = {}
    done = quiet_first_screen(cfg, env)
    assert ("DS_ACCELERATOR=cpu" in done) == (env.get("DS_ACCELERATOR") == "cpu") == (not has_accelerator())
    env = {"DS_ACCELERATOR": "cuda"}  # the user's choice stays
    quiet_first_screen(cfg, env)
    assert env == {"DS_ACCELERATOR": "cuda"}


def _foreign(lines: list[str]) -> list[str]:
    """Lines that are not hf_stable's: ours start with our prefixes, or sit in the optimizer group table."""
    out, in_table = [], False
    for line in lines:
        if line.startswith("optimizer: "):
            in_table = True
        if in_table:
            in_table = not line.startswith("total (")
            continue
        if line.strip() and not line.startswith(("[hf_stable] ", "step ", "done in ", "output: ")):
            out.append(line)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_readme_launch_prints_only_our_lines(tmp_path):
    """`accelerate launch scripts/finetune.py --training.max_steps 20` as the README shows it (no launch flags, the
    default install with DeepSpeed and bitsandbytes, the default recipe and its evaluation), on the test session's
    small embedded base so that it takes seconds."""
    cmd = [str(ACCELERATE), "launch", "scripts/finetune.py", "--training.max_steps", "20"]
    cmd += [*tiny_base_args(session_dir() / "bases", pretrain_steps=20), "--training.output_dir", str(tmp_path / "o")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("DS_ACCELERATOR", "PYTHONWARNINGS", "TOKENIZERS_PARALLELISM"):
        env.pop(name, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360, check=False)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join(lines[-60:])
    assert _foreign(lines) == [], "\n".join(lines)
    assert any(line.startswith("done in ") for line in lines)
