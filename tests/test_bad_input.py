"""Bad input through scripts/finetune.py: one line naming the file:line / key / path, exit code 2, no traceback,
nothing that looks finished — and checks that need only the config refuse before anything heavy is built.

The recipe's `main` runs in this process (an import of torch/transformers per case would cost ~20 s); an
exception other than the `SystemExit` of the error boundary fails the test with its traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.dist_scripts.harness import recipe_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("finetune_recipe", ROOT / "scripts" / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(recipe, capsys, args: list[str]) -> str:
    """Run the recipe on `args`; assert it exits with 2 and return its stderr."""
    with pytest.raises(SystemExit) as stop:
        recipe.main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err[-3000:]
    assert "Traceback" not in err
    return err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- config-only problems: refused at load, before the output dir, the model or the data exist -----------------


@pytest.mark.parametrize(
    "override, needle",
    [
        (["--training.per_device_train_batch_size", "0"], "training.per_device_train_batch_size: got 0, must be >= 1"),
        (["--training.per_device_eval_batch_size", "-2"], "training.per_device_eval_batch_size: got -2, must be >= 1"),
        (["--training.gradient_accumulation_steps", "0"], "training.gradient_accumulation_steps: got 0"),
        (["--training.max_steps", "0"], "training.max_steps: got 0, must be > 0, or -1"),
        (["--training.save_steps", "0"], "training.save_steps: got 0.0, must be > 0"),
        (["--training.report_to", "[none_such]"], "training.report_to: 'none_such' is not an integration"),
        (
            ["--training.max_steps", "-1", "--stability.guards.batch_warmup.enabled", "true"],
            "training.max_steps: got -1; stability.guards.batch_warmup",
        ),
        (["--training.learning_rate", "0"], "training.learning_rate: got 0.0, must be > 0"),
    ],
)
def test_config_only_problems_stop_before_anything_is_built(recipe, capsys, tmp_path, override, needle):
    out = tmp_path / "out"
    started = time.monotonic()
    err = refused(recipe, capsys, recipe_args(out) + override)
    assert needle in err, err[-2000:]
    assert len(error_lines(err)) == 1
    assert not out.exists()  # refused at load: no output dir, no model, no data, no evaluation
    assert time.monotonic() - started < 30


def test_report_to_an_integration_that_is_not_installed(recipe, capsys, tmp_path, monkeypatch):
    import transformers.integrations.integration_utils as integrations

    available = integrations.get_available_reporting_integrations()
    monkeypatch.setattr(
        integrations, "get_available_reporting_integrations", lambda: [n for n in available if n != "tensorboard"]
    )
    out = tmp_path / "out"
    err = refused(recipe, capsys, recipe_args(out) + ["--training.report_to", "tensorboard"])
    assert "training.report_to: 'tensorboard' is not installed: pip install tensorboard" in err
    assert not out.exists()


def test_yaml_alias_bomb_is_refused_quickly_naming_the_key(recipe, capsys, tmp_path):
    lines = ['  a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(
        "# 9 levels x 9 aliases: 9**9 values\nanchors:\n" + "\n".join(lines) + "\nlora:\n  target_modules: *a8\n"
    )
    started = time.monotonic()
    err = refused(recipe, capsys, ["--config", str(bomb), "--training.output_dir", str(tmp_path / "out")])
    assert time.monotonic() - started < 10
    (line,) = [x for x in err.splitlines() if "expands to" in x]
    assert str(bomb) in line and "anchors.a5 expands to 597,871 values" in line and len(line) < 400


def test_messages_show_a_bounded_value(recipe, capsys, tmp_path):
    huge = "[" + ", ".join(["q_proj"] * 50_000) + "]"
    err = refused(recipe, capsys, recipe_args(tmp_path / "out") + ["--lora.r", huge])
    (line,) = [x for x in err.splitlines() if "lora.r:" in x]
    assert "expected an integer" in line and len(line) < 300


# ---- data problems: named by file:line (or skipped and counted) ---------------------------------------------


def test_lone_surrogate_in_a_record_names_the_line(recipe, capsys, tmp_path):
    good = recipe_args(tmp_path / "out")
    train = Path(good[good.index("--data.train_file") + 1]).read_text(encoding="utf-8").splitlines()[:16]
    bad = write_jsonl(tmp_path / "bad.jsonl", [*train[:3], '{"instruction": "1 + 1?", "output": "2 \\ud800"}'])
    err = refused(recipe, capsys, good + ["--data.train_file", str(bad)])
    (line,) = error_lines(err)
    assert f"{bad}:4: field 'output' holds a lone surrogate \\ud800" in line
    assert not (tmp_path / "out" / "run_summary.json").exists()
    assert json.loads((tmp_path / "out" / "RUN_INCOMPLETE.json").read_text())["status"] == "failed"


def test_answer_empty_after_cleaning_is_an_error_naming_the_line(recipe, capsys, tmp_path):
    good = recipe_args(tmp_path / "out")
    train = Path(good[good.index("--data.train_file") + 1]).read_text(encoding="utf-8").splitlines()[:16]
    bad = write_jsonl(tmp_path / "bad.jsonl", [*train[:5], '{"instruction": "Say it", "output": " \\u200b\\u0007 "}'])
    err = refused(recipe, capsys, good + ["--data.train_file", str(bad)])
    assert f"{bad}:6: field 'output' is empty after cleaning" in error_lines(err)[0]
    assert not (tmp_path / "out" / "run_summary.json").exists()


# ---- the output directory ------------------------------------------------------------------------------------


def test_a_file_where_the_output_dir_should_be(recipe, capsys, tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    err = refused(recipe, capsys, recipe_args(blocker))
    (line,) = error_lines(err)
    assert f"training.output_dir: cannot use {blocker}: [EEXIST]" in line and "a file is in the way" in line
    assert blocker.read_text() == "not a directory"


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write: chmod for a normal user, a read-only tmpfs for root."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    cmd = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)]
    mounted = subprocess.run(cmd, capture_output=True, check=False, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"root cannot mount a read-only tmpfs here: {mounted.stderr.decode()[:200]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False, timeout=30)


def test_output_dir_under_a_read_only_parent(recipe, capsys, read_only_dir):
    out = read_only_dir / "run" / "out"
    (line,) = error_lines(refused(recipe, capsys, recipe_args(out)))
    assert f"training.output_dir: cannot use {out}:" in line and ("EROFS" in line or "EACCES" in line)


def test_an_existing_read_only_output_dir_gives_one_message(recipe, capsys, read_only_dir):
    err = refused(recipe, capsys, recipe_args(read_only_dir))
    (line,) = error_lines(err)
    assert f"training.output_dir: cannot use {read_only_dir}:" in line and ("EROFS" in line or "EACCES" in line)
    assert "During handling" not in err
