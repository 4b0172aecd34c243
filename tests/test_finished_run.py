"""A new run into a finished run's output dir: refused with one line, or (runtime.overwrite) the old run moved aside."""

from __future__ import annotations

import json

import pytest

from hf_stable.checkpoints import latest_complete_checkpoint, mark_complete
from hf_stable.config import load_config
from hf_stable.outputs import OutputDir, error_boundary

OLD_FILES = (
    "adapter_model.safetensors",
    "run_summary.json",
    "README.md",
    "quarantine.jsonl",
    "stability_events.jsonl",
    "report/bad_step_samples.png",
    "checkpoint-4/adapter_model.safetensors",
)


def _finished_run(root):
    for name in OLD_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"old run: " + name.encode())
    mark_complete(root / "checkpoint-4", 4)
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_finished_run_is_refused_with_one_line_and_left_untouched(tmp_path, capsys):
    before = _finished_run(tmp_path)
    with pytest.raises(SystemExit) as exit_, error_boundary():
        OutputDir(tmp_path).start({})
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: training.output_dir: {tmp_path} holds a finished run (run_summary.json of ")
    assert f"--training.output_dir {tmp_path}-2" in err and "--runtime.overwrite true" in err, err
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing renamed, removed or added


def test_overwrite_moves_every_entry_aside_once_and_starts_fresh(tmp_path, capsys):
    _finished_run(tmp_path)
    OutputDir(tmp_path, overwrite=True).start({"a": 1})
    out = capsys.readouterr().out.strip().splitlines()
    moved = [line for line in out if line.startswith("runtime.overwrite:")]
    assert len(moved) == 1, out
    entries = ["README.md", "adapter_model.safetensors", "checkpoint-4", "quarantine.jsonl", "report"]
    entries += ["run_summary.json", "stability_events.jsonl"]
    (replaced,) = tmp_path.glob("replaced-*")
    assert moved[0].endswith(f"moved its 7 entries to {replaced}: {', '.join(sorted(entries))}"), moved[0]
    # nothing of the old run beside the new one: only the new run's own start files, and the old run kept whole
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["RUN_INCOMPLETE.json", "resolved_config.yaml", replaced.name]
    )
    assert json.loads((tmp_path / "RUN_INCOMPLETE.json").read_text())["status"] == "running"
    assert (replaced / "report/bad_step_samples.png").read_bytes() == b"old run: report/bad_step_samples.png"
    assert latest_complete_checkpoint(tmp_path) is None  # `resume: auto` starts fresh, not from the old run
    # the moved run is not "finished" here any more: a second start neither refuses nor moves anything
    OutputDir(tmp_path).start({"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["RUN_INCOMPLETE.json", "resolved_config.yaml", replaced.name]
    )


def test_overwrite_never_empties_the_current_directory(tmp_path, monkeypatch, capsys):
    before = _finished_run(tmp_path)
    (tmp_path / "my_notes.txt").write_text("the user's own file")
    before["my_notes.txt"] = b"the user's own file"
    monkeypatch.chdir(tmp_path)  # `training.output_dir: .`
    with pytest.raises(SystemExit) as exit_, error_boundary():
        OutputDir(tmp_path, overwrite=True).start({})
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "is the current directory" in err and len(err.splitlines()) == 1, err
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == {str(k): v for k, v in before.items()}  # nothing moved


def test_an_unfinished_run_is_resumed_not_refused(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "RUN_INCOMPLETE.json").write_text('{"status": "preempted"}')
    OutputDir(tmp_path).start({})  # no finished run: no refusal (a preempted run is continued by the same command)
    assert (tmp_path / "checkpoint-2").is_dir() and not list(tmp_path.glob("replaced-*"))


def test_runtime_overwrite_is_a_config_field():
    assert load_config().runtime.overwrite is False
    assert load_config(argv=["--runtime.overwrite", "true"]).runtime.overwrite is True
