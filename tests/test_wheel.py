"""The wheel works outside the checkout.

Built offline from a copy of the package sources, installed with `--no-deps` into a fresh venv in a temporary
directory, with the project venv's dependencies on its path but not the checkout's editable hf_stable, it runs
`hf-stable doctor --config <copied recipe>` and writes a model card from a working directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import hf_stable

pytestmark = [pytest.mark.wheel, pytest.mark.timeout(300)]  # ~20 s on 2 idle cores

ROOT = Path(__file__).resolve().parents[1]
# The recipe on a seconds-to-build tiny base (as tests/test_doctor.py runs it).
TINY_BASE = {
    "model.embedded.hidden_size": 64,
    "model.embedded.intermediate_size": 128,
    "model.embedded.num_hidden_layers": 2,
    "model.embedded.vocab_size": 512,
    "model.embedded.pretrain_steps": 0,
    "training.per_device_train_batch_size": 8,
}

# Run inside the fresh venv: where hf_stable comes from, its version, the packaged default recipe, and a model card
# written through the library API into the doctor's output directory (the doctor report becomes one of its sections).
CARD_SCRIPT = """
import json, sys
from pathlib import Path
import importlib.metadata as md
import hf_stable
from hf_stable.config import DEFAULT_CONFIG, load_config
from hf_stable.reporting.model_card import write_model_card
from hf_stable.reporting.report import render_report

out = Path(sys.argv[1])
cfg = load_config()  # no path: the packaged default recipe
card = write_model_card(
    out, config=cfg.to_dict(), base_model=cfg.model.name_or_path,
    summary={"eval_loss_before": 6.25, "eval_loss_after": 5.99, "train_steps": 10, "wall_seconds": 2.9,
             "n_trainable_parameters": 32768, "n_parameters": 100000},
    stability_section=render_report(out), doctor_section=(out / "doctor_report.md").read_text(encoding="utf-8"),
)
print(json.dumps({"file": hf_stable.__file__, "version": hf_stable.__version__, "dist": md.version("hf-stable"),
                  "default_config": str(DEFAULT_CONFIG), "train_file": cfg.data.train_file, "card": str(card)}))
"""


def _copy_sources(dst: Path) -> Path:
    """What the build reads (pyproject, setup.py, README, the package) in a scratch dir: the checkout stays as is."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    shutil.copytree(ROOT / "hf_stable", dst / "hf_stable", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _dependency_dir(dst: Path) -> Path:
    """Symlinks to every top-level entry of this venv's site-packages except hf_stable's own.

    A .pth line naming site-packages itself would run `__editable__.hf_stable-*.pth` there (site processes .pth
    files of every directory it adds) and bring the checkout back; .pth files in a plain path entry are not run.
    """
    site = Path(sysconfig.get_paths()["purelib"])
    dst.mkdir()
    for entry in site.iterdir():
        low = entry.name.lower()
        if low.startswith(("hf_stable", "hf-stable", "__editable__")) or low.endswith(".pth"):
            continue
        (dst / entry.name).symlink_to(entry)
    return dst


def _run(cmd: list, cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:3]} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_wheel_runs_outside_the_checkout(tmp_path):
    assert not tmp_path.resolve().is_relative_to(ROOT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")

    # Build offline: no build isolation (setuptools is in this venv), no index.
    (tmp_path / "src").mkdir()
    src = _copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, src], tmp_path, env, 120)
    (wheel,) = wheels.glob("hf_stable-*.whl")
    assert wheel.name.startswith(f"hf_stable-{hf_stable.__version__}-"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    for shipped in (
        "hf_stable_launcher.pth",
        "hf_stable/recipes/default.yaml",
        "hf_stable/templates/model_card.md",
        "hf_stable/embedded/data/train.jsonl",
        "hf_stable/embedded/data/eval.jsonl",
    ):
        assert shipped in names, shipped

    # A fresh venv outside the checkout; the wheel alone, dependencies from this venv without the editable finder.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env, 60)
    python = venv / "bin" / "python"
    _run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], tmp_path, env, 120)
    where = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env, 60)
    purelib = Path(where.stdout.strip())
    assert (purelib / "hf_stable_launcher.pth").is_file()
    # Inside the venv's prefix, as installed dependencies are: dill (datasets' fingerprints) pickles modules from
    # outside sys.prefix by value, and pyarrow's cannot be.
    (purelib / "_test_dependencies.pth").write_text(f"{_dependency_dir(venv / 'dependencies')}\n", encoding="utf-8")

    # A user's directory: a copied recipe and nothing else.
    work = tmp_path / "work"
    work.mkdir()
    recipe = work / "recipe.yaml"
    recipe.write_text((ROOT / "configs" / "default.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    out = work / "out"
    overrides = {**TINY_BASE, "model.embedded.cache_dir": work / "bases", "training.output_dir": out}
    doctor = [venv / "bin" / "hf-stable", "doctor", "--config", recipe, "--output", out]
    doctor += [arg for key, value in overrides.items() for arg in (f"--{key}", value)]
    proc = _run([str(a) for a in doctor], work, env, 240)
    report = json.loads((out / "doctor_report.json").read_text(encoding="utf-8"))
    assert report["exit_code"] == 0, proc.stdout[-3000:]
    checks = {f["check"]: f for f in report["findings"]}
    assert checks["dry_run.loss"]["severity"] == "ok", checks["dry_run.loss"]  # the packaged data was read and trained
    assert f"hf-stable {hf_stable.__version__}" in checks["environment.versions"]["evidence"]

    info = json.loads(_run([python, "-c", CARD_SCRIPT, out], work, env, 120).stdout.strip().splitlines()[-1])
    assert Path(info["file"]).is_relative_to(purelib) and not Path(info["file"]).resolve().is_relative_to(ROOT), info
    assert info["version"] == info["dist"] == hf_stable.__version__
    assert Path(info["default_config"]).is_relative_to(purelib) and info["train_file"] == "embedded:train"
    card = Path(info["card"])
    assert card == out / "README.md" and card.is_file()
    text = card.read_text(encoding="utf-8")
    for section in (
        "## Results",
        "## Data",
        "## Hyperparameters",
        "## Training stability",
        "## Preflight doctor",
        "## Framework versions",
    ):
        assert section in text, section
    assert f"- hf-stable {hf_stable.__version__}" in text
    assert "- train: `embedded:train`" in text and "clean bill of health" in text
