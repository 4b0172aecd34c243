"""What an installed hf_stable reads from itself: package data (one copy, linked from the checkout), the packaged
`embedded:` datasets, and one version source. The wheel built and run outside the checkout: test_wheel.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import hf_stable
from hf_stable.config import DEFAULT_CONFIG, load_config
from hf_stable.data.records import read_records
from hf_stable.errors import ConfigError, DataError
from hf_stable.reporting import model_card

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(hf_stable.__file__).resolve().parent


def test_checkout_paths_are_links_to_the_package_data():
    assert DEFAULT_CONFIG.parent == PACKAGE / "recipes" and model_card.TEMPLATE.parent == PACKAGE / "templates"
    for link, packaged in (
        ("configs/default.yaml", DEFAULT_CONFIG),
        ("model_cards/template.md", model_card.TEMPLATE),
        ("data/embedded", PACKAGE / "embedded" / "data"),
    ):
        assert (ROOT / link).is_symlink(), f"{link} must link to {packaged} (one copy)"
        assert (ROOT / link).resolve() == packaged.resolve()
    # a recipe in configs/ still extends the default through the link
    assert load_config(ROOT / "configs" / "tiny-qwen2.yaml").data.train_file == "embedded:train"


def test_embedded_data_paths_name_the_packaged_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: the names do not depend on the working directory
    cfg = load_config()
    assert (cfg.data.train_file, cfg.data.eval_file) == ("embedded:train", "auto")  # auto: embedded:eval here
    got = read_records("embedded:eval", config_field="data.eval_file")
    expected = (ROOT / "data" / "embedded" / "eval.jsonl").read_text(encoding="utf-8").splitlines()
    assert got.n_lines == len(expected) == 200 and got.records[0].path == "embedded:eval"

    with pytest.raises(ConfigError) as err:
        load_config(argv=["--data.eval_file", "embedded:evl"])
    assert (
        "data.eval_file: got 'embedded:evl', the packaged datasets are: embedded:train, embedded:eval, embedded:grpo, embedded:pairs_train, "
        "embedded:pairs_eval" in str(err.value)
    )
    with pytest.raises(DataError, match=r"^data.train_file: embedded:tran is not a packaged dataset; they are: "):
        read_records("embedded:tran")
    (tmp_path / "embedded").mkdir()  # a relative path that merely looks similar is still a path
    with pytest.raises(DataError, match=r"embedded/train.jsonl does not exist \(working directory "):
        read_records("embedded/train.jsonl")


def test_one_version_source(tmp_path, monkeypatch):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hf_stable.__version__"}

    # The card and the doctor print the version of the code that runs, not a copy (nor stale install metadata).
    monkeypatch.setattr(hf_stable, "__version__", "9.8.7")
    from hf_stable.doctor.environment import package_versions

    assert package_versions()["hf-stable"] == "9.8.7"
    cfg = load_config()
    card = model_card.write_model_card(tmp_path, config=cfg.to_dict(), summary={}, base_model="embedded:tiny-llama")
    text = card.read_text(encoding="utf-8")
    assert "\n- hf-stable 9.8.7\n" in text
    meta = yaml.safe_load(text.split("---")[1])
    assert meta["datasets"] == ["embedded"]  # the packaged dataset keeps the name data/embedded/ gave it
    assert os.path.basename(card) == "README.md"
