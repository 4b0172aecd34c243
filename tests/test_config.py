"""Config loading: typed sections, dotted overrides, extends, and one ConfigError listing every problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_stable.config import load_config, training_arguments
from hf_stable.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_default_loads_with_typed_sections():
    cfg = load_config()
    assert cfg.model.is_embedded and cfg.model.embedded_arch == "llama"
    assert isinstance(cfg.lora.r, int) and isinstance(cfg.training["learning_rate"], float)
    assert cfg.source.endswith("default.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    args = training_arguments(cfg, use_cpu=True)  # builds TrainingArguments; downloads nothing
    assert args.output_dir and args.learning_rate > 0
    text = path.read_text().splitlines()
    assert text[0].startswith("#") and any("Launch:" in line for line in text[:4]), (
        "YAML must open with purpose + launch"
    )


def test_dotted_overrides_are_typed(tmp_path):
    cfg = load_config(
        argv=[
            "--training.learning_rate",
            "1e-4",
            "--lora.r=8",
            "--data.packing",
            "false",
            "--lora.target_modules",
            "[q_proj]",
        ]
    )
    assert cfg.training["learning_rate"] == pytest.approx(1e-4)
    assert cfg.lora.r == 8 and cfg.data.packing is False and cfg.lora.target_modules == ["q_proj"]


def test_yaml_1e_minus_4_without_dot_is_a_float(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("# t\ntraining:\n  learning_rate: 1e-4\nlora:\n  alpha: 1e1\n")
    cfg = load_config(p)
    assert cfg.training["learning_rate"] == pytest.approx(1e-4) and cfg.lora.alpha == 10.0


def test_all_problems_reported_at_once(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(
        "model:\n  name_or_path: embedded:tiny-gpt\nlora:\n  r: x\n  dropout: 1.5\n"
        "data:\n  packing: maybe\nfoo: 1\ntraining:\n  learning_rat: 0.1\n  num_train_epochs: many\n"
    )
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert len(exc.value.problems) == 7, msg
    for needle in (
        "model.name_or_path: got 'embedded:tiny-gpt'",
        "lora.r: got 'x', expected an integer",
        "lora.dropout: got 1.5",  # a rule from the section's validate()
        "data.packing: got 'maybe'",
        "foo: unknown key",
        "training.learning_rat: not a TrainingArguments field (did you mean learning_rate?)",
        "training.num_train_epochs: got 'many'",
    ):
        assert needle in msg, f"missing {needle!r} in\n{msg}"
    assert str(p) in msg


def test_literal_choices_are_listed():
    with pytest.raises(ConfigError, match=r"data.on_bad_record: got 'ignore', allowed: one of 'error', 'skip'"):
        load_config(argv=["--data.on_bad_record", "ignore"])


def test_missing_file_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name_or_path: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(bad)


def test_extends_deep_merges_and_detects_cycles(tmp_path):
    (tmp_path / "a.yaml").write_text("lora:\n  r: 4\n  alpha: 8\ntraining:\n  seed: 1\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\nlora:\n  r: 2\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.lora.r, cfg.lora.alpha, cfg.training["seed"]) == (2, 8.0, 1)
    (tmp_path / "c.yaml").write_text("extends: d.yaml\n")
    (tmp_path / "d.yaml").write_text("extends: c.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "c.yaml")


def test_bad_training_value_names_training(tmp_path):
    cfg = load_config(argv=["--training.lr_scheduler_type", "zigzag"])
    with pytest.raises(ConfigError, match="training: TrainingArguments rejected"):
        training_arguments(cfg)


def test_cli_unknown_argument():
    with pytest.raises(ConfigError, match="unexpected argument"):
        load_config(argv=["positional"])


def test_config_reference_doc_is_current():
    from hf_stable.config.reference import render

    doc = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"
    assert doc.read_text(encoding="utf-8") == render(), (
        "regenerate: python -m hf_stable.config.reference > docs/CONFIG.md"
    )


def test_yaml_alias_bomb_is_refused_in_any_section_without_expanding_it(tmp_path):
    import time

    levels = ['  a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    for section in ("lora:\n  target_modules: *a8", "training:\n  report_to: *a8", "data:\n  extra: *a8"):
        bomb = tmp_path / "bomb.yaml"
        bomb.write_text("# bomb\nanchors:\n" + "\n".join(levels) + f"\n{section}\n")
        started = time.monotonic()
        with pytest.raises(ConfigError, match=r"anchors\.a5 expands to 597,871 values through YAML anchors"):
            load_config(bomb)
        assert time.monotonic() - started < 5
    endless = tmp_path / "endless.yaml"
    endless.write_text("# t\nlora:\n  target_modules: &a [q_proj, *a]\n")
    with pytest.raises(ConfigError, match="lora.target_modules expands to an endless recursive alias"):
        load_config(endless)
    with pytest.raises(ConfigError, match="expands to an endless"):  # an override on the command line too
        load_config(argv=["--lora.target_modules", "&a [x, *a]"])


def test_config_checks_run_at_load_and_can_be_deferred():
    argv = [
        "--training.per_device_train_batch_size",
        "0",
        "--training.dataloader_num_workers",
        "-1",
        "--training.num_train_epochs",
        "0",
        "--training.max_steps",
        "-1",
        "--training.report_to",
        "nope",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(argv=argv)
    assert (
        err.value.problems
        == [
            "training.per_device_train_batch_size: got 0, must be >= 1",
            "training.num_train_epochs: got 0.0, must be > 0 (or set training.max_steps > 0)",
            "training.dataloader_num_workers: got -1, must be >= 0",
            err.value.problems[3],
        ]
        and "training.report_to: 'nope' is not an integration" in err.value.problems[3]
    )
    cfg = load_config(argv=argv, check=False)  # the doctor reports them as findings instead
    assert cfg.training["per_device_train_batch_size"] == 0


def test_a_huge_value_in_a_message_is_cut():
    with pytest.raises(ConfigError) as err:
        load_config(argv=["--lora.r", "x" * 100_000])
    (line,) = err.value.problems
    assert line.startswith("lora.r: got 'xxx") and "expected an integer" in line and len(line) < 200


def test_override_problems_are_located_on_the_command_line(tmp_path):
    # a typo in an override is the command line's, not the recipe file's (often the packaged default.yaml)
    with pytest.raises(ConfigError) as exc:
        load_config(argv=["--lora.rank", "8"])
    msg = str(exc.value)
    assert msg.startswith("1 configuration problem(s) in the command-line arguments:"), msg
    assert "default.yaml" not in msg and "lora.rank: unknown key, did you mean r?" in msg, msg
    # one problem from the file, one from the command line: each said where it is
    p = tmp_path / "c.yaml"
    p.write_text("# t\nlora:\n  r: zero\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p, argv=["--training.learning_rat", "1"])
    msg = str(exc.value)
    assert f"in {p} and the command-line arguments:" in msg, msg
    assert "lora.r: got 'zero', expected an integer\n" in msg + "\n", msg
    assert "training.learning_rat: not a TrainingArguments field (did you mean learning_rate?) [command-line" in msg


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("lora.rank", "r"),
        ("data.on_bad_records", "on_bad_record"),
        ("runtime.resum", "resume"),
        ("optim.nmae", "name"),
    ],
)
def test_did_you_mean_in_every_section(key, meant):
    with pytest.raises(ConfigError) as exc:
        load_config(argv=[f"--{key}", "1"])
    assert f"{key}: unknown key, did you mean {meant}?" in str(exc.value), str(exc.value)


def test_unknown_key_far_from_any_field_gets_no_guess():
    with pytest.raises(ConfigError) as exc:
        load_config(argv=["--lora.zzzzzz", "1"])
    assert "lora.zzzzzz: unknown key (allowed in 'lora':" in str(exc.value)


def test_missing_engine_package_is_one_config_problem(monkeypatch, capsys):
    from hf_stable import import_utils
    from hf_stable.outputs import error_boundary

    argv = ["--training.deepspeed", "configs/deepspeed/zero2.json"]
    load_config(argv=argv)  # installed here: no problem (no false alarm)
    # DeepSpeed uninstalled (the default setup without the extra): what transformers met as PackageNotFoundError
    monkeypatch.setattr(import_utils, "is_deepspeed_available", lambda: False)
    with pytest.raises(SystemExit) as exit_, error_boundary():
        load_config(argv=argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert err.startswith("error: 1 configuration problem(s) in the command-line arguments:"), err
    assert (
        "training.deepspeed: 'configs/deepspeed/zero2.json' needs DeepSpeed, which is not installed: pip install \"hf-stable[deepspeed]\""
        in err
    )
