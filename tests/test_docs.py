"""The README and docs/ as written: their Python blocks run, their commands run or validate, their links resolve.

* Every ```python block of README.md and docs/*.md runs, with a tiny local model in place of the Hub checkpoint it
  names (and the few other substitutions below, each of which must still match the text).
* Every command line of a ```bash / ```sh / ```console block is classified (`classify`); an unclassified one fails.
  Recipe launches on a config that runs offline on CPU (an `embedded:` base) and the `hf-stable` commands run, in a
  scratch directory, with the step cap the docs state (`--training.max_steps N`) appended to recipe launches: one
  shared run of the default recipe serves the commands that read its output (export, audit). A recipe launch on a
  GPU / Hub config is loaded through `load_config` (unknown keys, wrong types and bad values fail) without
  downloading anything; `make` targets, test invocations and extras are checked to exist.
* Every relative link resolves to a file, and an anchor to one of its headings' GitHub slugs.

docs/_incoming_*.md (notes waiting to be folded into the guides) are left out.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from transformers import GenerationConfig

from tests.helpers import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
HUB_MODEL = '"Qwen/Qwen2.5-0.5B-Instruct"'
STEP_CAP = ["--training.max_steps", "2"]  # the override form docs/configuration.md and the README state
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def doc_files() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if not p.name.startswith("_incoming_"))
    return [ROOT / "README.md", *docs]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(langs: set[str]) -> list[tuple[str, int, str]]:
    """(file, line of the opening fence, body) of every fenced block in one of `langs`, in document order."""
    found = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(1) in langs:
                found.append((_rel(path), text.count("\n", 0, m.start()) + 1, m.group(2)))
    return found


# --- Python blocks ---------------------------------------------------------------------------------------------


def python_blocks() -> list[tuple[str, int, str]]:
    return fenced_blocks({"python"})


@pytest.fixture(scope="module")
def tiny_hub_model(tokenizer, tmp_path_factory) -> Path:
    """A random-init tiny Qwen2 with the tests' tokenizer, saved as a Hub checkpoint directory is."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_tiny_model("qwen2", tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def substitutions(model_dir: Path) -> dict[str, str]:
    return {
        HUB_MODEL: repr(str(model_dir)),
        '"configs/qwen2.5-0.5b-lora.yaml"': repr(str(ROOT / "configs/qwen2.5-0.5b-lora.yaml")),  # run from a tmp dir
        "max_steps=1000": "max_steps=2",
        'DPOConfig("out-dpo",': 'DPOConfig("out-dpo", use_cpu=True,',  # TRL's configs default to bf16 on a GPU
        'GRPOConfig(\n    "out-grpo",': 'GRPOConfig(\n    "out-grpo", use_cpu=True,',
    }


def _check_full_own_trainer_example(ns: dict, tmp_path: Path) -> None:
    """docs/own-trainer.md: the stock Trainer with every piece; the adapter, the stop tokens and the audit."""
    trainer, data, hook = ns["trainer"], ns["data"], ns["my_callback"]
    assert trainer.state.global_step == 2 and hook.params_with_grad > 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    saved = GenerationConfig.from_pretrained(tmp_path / "out")
    assert saved.eos_token_id == data.stop_token_ids == [ns["tokenizer"].eos_token_id]
    assert data.audit["train"]["sample"]["marked"].endswith("<|end_of_text|>⟧")


def _check_stable_trainer_example(ns: dict, tmp_path: Path) -> None:
    """README: `StableTrainer` with `build_callbacks`: trained with the monitors and guards (and the forensics when
    the recipe's `data.quarantine` asks for them), the model on hf_stable's attention."""
    trainer, cfg = ns["trainer"], ns["cfg"]
    names = {type(cb).__name__ for cb in trainer.callback_handler.callbacks}
    assert trainer.state.global_step == 2 and ns["model"].config._attn_implementation == "hf_stable"
    assert {"GradientMonitor", "SkipGuard", "RollbackGuard", "AttentionMonitorCallback"} - names == set(), sorted(
        names
    )
    assert ("SpikeForensics" in names) == (cfg.data.quarantine != "off")


def _check_attention_example(ns: dict, tmp_path: Path) -> None:
    assert ns["model"].config._attn_implementation == "hf_stable"


def _check_chunked_loss_example(ns: dict, tmp_path: Path) -> None:
    """The stock-Trainer example of the chunked loss trains, and its steps call the head on chunks ([rows, H])."""
    import torch
    from transformers import TrainingArguments

    model, ranks = ns["model"], []
    model.lm_head.register_forward_hook(lambda m, a, o: ranks.append(a[0].dim()))
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(
        tmp_path / "chunked", max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    trainer = ns["ChunkedLossTrainer"](model=model, args=args, train_dataset=rows)
    trainer.train()
    assert trainer.state.global_step == 2 and ranks == [2] * 4  # per step: the forward and the backward's recompute


def _check_stabilize_example(ns: dict, tmp_path: Path) -> None:
    """docs/own-trainer.md: `stabilize` on a real DPOTrainer trains with the guards judging the DPO loss."""
    trainer = ns["trainer"]
    names = {type(cb).__name__ for cb in trainer.callback_handler.callbacks}
    assert trainer.state.global_step == 2 and type(trainer).__name__ == "StableDPOTrainer"
    assert {"GradientMonitor", "SkipGuard", "RollbackGuard"} <= names
    skip = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "SkipGuard")
    assert abs(skip.last_verdict.loss - 0.6931) < 0.05  # the DPO loss near ln 2, not the sequences' NLL


def _check_post_training_example(ns: dict, tmp_path: Path) -> None:
    """docs/post-training.md: `stabilize` on a real GRPOTrainer reads TRL's reward signals into posttrain/*."""
    trainer = ns["trainer"]
    assert trainer.state.global_step == 2 and type(trainer).__name__ == "StableGRPOTrainer"
    assert "PostTrainMonitor" in {type(cb).__name__ for cb in trainer.callback_handler.callbacks}
    rows = [h for h in trainer.state.log_history if "reward" in h]
    assert len(rows) == 2 and all(h["posttrain/reward"] == h["reward"] for h in rows)


# A block is recognised by a line it holds; each check asserts what the block promises. A block without a check runs.
CHECKS = {
    "class MyGradientHook(TrainerCallback)": _check_full_own_trainer_example,
    "trainer = StableTrainer(": _check_stable_trainer_example,
    "register(AttentionConfig(softcap=None))": _check_attention_example,
    "class ChunkedLossTrainer(Trainer)": _check_chunked_loss_example,
    "hf_stable.stabilize(trainer)": _check_stabilize_example,
    "hf_stable.stabilize(  # the same line": _check_post_training_example,
}


def _check_for(block: str):
    found = [check for marker, check in CHECKS.items() if marker in block]
    assert len(found) <= 1, "a block matches two checks"
    return found[0] if found else None


def test_the_checked_examples_are_in_the_docs():
    blocks = [b for _, _, b in python_blocks()]
    for marker in CHECKS:
        assert sum(marker in b for b in blocks) == 1, f"no single Python block holds {marker!r}"
    assert all(HUB_MODEL in b for b in blocks if "from_pretrained(" in b)


@pytest.mark.parametrize("where,line,block", python_blocks(), ids=[f"{f}:{n}" for f, n, _ in python_blocks()])
def test_python_blocks_run_as_written(where, line, block, tiny_hub_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for old, new in substitutions(tiny_hub_model).items():
        block = block.replace(old, new)
    assert "Qwen/" not in block, f"{where}:{line} names a Hub model the test does not substitute"
    namespace: dict = {"__name__": f"docs_block_{line}"}
    exec(compile(block, f"{where} python block at line {line}", "exec"), namespace)  # noqa: S102 - the docs' own code
    check = _check_for(block)
    if check is not None:
        check(namespace, tmp_path)


# --- Shell commands --------------------------------------------------------------------------------------------


def shell_commands() -> list[tuple[str, int, str]]:
    """(file, line, command) of every command line in a shell block; prompts and trailing comments stripped."""
    found = []
    for where, start, body in fenced_blocks(SHELL_LANGS):
        for offset, raw in enumerate(body.splitlines(), start=1):
            line = raw.strip()
            line = line.removeprefix("$ ")
            line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if line and not line.startswith("#"):
                found.append((where, start + offset, line))
    return found


@dataclass
class Command:
    kind: str  # recipe-run | recipe-validate | cli | make | pytest | pip | generator | checked-elsewhere
    argv: list[str]
    script_args: list[str]  # for a recipe launch: the arguments after scripts/finetune.py
    launch_config: str | None = None


def _recipe_config(script_args: list[str]) -> dict:
    from hf_stable.config import load_config

    return load_config(argv=script_args)


def classify(command: str) -> Command:
    """What the test does with a documented command line (unknown commands fail: classify them here)."""
    argv = shlex.split(command.replace("~", "\\~"))
    argv = [a.replace("\\~", "~") for a in argv]
    if "scripts/finetune.py" in argv:
        i = argv.index("scripts/finetune.py")
        launcher = argv[:i]
        assert launcher[:2] == ["accelerate", "launch"] or launcher in (["python"], []), command
        launch_config = launcher[launcher.index("--config_file") + 1] if "--config_file" in launcher else None
        script_args = argv[i + 1 :]
        cfg = _recipe_config(script_args)
        offline_cpu = str(cfg.model.name_or_path).startswith("embedded:") and launch_config is None
        return Command("recipe-run" if offline_cpu else "recipe-validate", argv, script_args, launch_config)
    if argv[0] == "hf-stable":
        assert argv[1] in {"doctor", "export", "audit", "report"}, command
        return Command("cli", argv, [])
    if argv[0] == "make":
        return Command("make", argv, [])
    if argv[0].endswith("pytest"):
        return Command("pytest", argv, [])
    if argv[:2] == ["pip", "install"]:
        return Command("pip", argv, [])
    if argv[:3] == ["python", "-m", "hf_stable.config.reference"]:
        return Command("generator", argv, [])
    if argv == ["python", "scripts/make_dataset.py"]:  # rewrites data/embedded: tests/test_embedded.py compares them
        return Command("checked-elsewhere", argv, [])
    raise AssertionError(f"unclassified documented command {command!r}: classify it in tests/test_docs.py")


def _params():
    out = []
    for where, line, command in shell_commands():
        try:
            kind = classify(command).kind
        except Exception:  # noqa: BLE001 - an unknown command or a bad config fails in its own test, not at collection
            kind = "broken"
        # a recipe run takes minutes on 2 busy cores (the default's first launch also builds its base)
        marks = [pytest.mark.slow, pytest.mark.timeout(1800)] if kind in ("recipe-run", "cli") else []
        out.append(pytest.param(where, line, command, marks=marks, id=f"{where}:{line}"))
    return out


def test_every_documented_command_is_classified():
    commands = shell_commands()
    kinds = {classify(c).kind for _, _, c in commands}
    assert {"recipe-run", "recipe-validate", "cli", "make"} <= kinds, kinds


def test_ci_runs_the_readmes_test_command():
    setup = [c for w, _, c in shell_commands() if w == "README.md" and c.startswith("make ")]
    assert setup == ["make demo", "make test"], setup
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8").splitlines()
    assert "make test" in [line.split("#")[0].strip() for line in ci]


def _workdir(path: Path) -> Path:
    """A scratch working directory that sees the checkout's scripts, configs and data (outputs land in it)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("scripts", "configs", "data"):
        link = path / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """Where the embedded bases are built ($HF_STABLE_CACHE when set: a developer's cache is reused)."""
    return Path(os.environ["HF_STABLE_CACHE"]) if os.environ.get("HF_STABLE_CACHE") else tmp_path_factory.mktemp("hfs")


def _env(cache: Path) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "HF_STABLE_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": path,
    }


def _executable(name: str) -> list[str]:
    """The venv's console script when installed, else its module (the checkout without `pip install -e`)."""
    script = Path(sys.executable).parent / name
    if script.is_file():
        return [str(script)]
    return [
        sys.executable,
        "-m",
        {"accelerate": "accelerate.commands.accelerate_cli", "hf-stable": "hf_stable.cli"}[name],
    ]


def _placeholders(argv: list[str], cache: Path) -> list[str]:
    """Paths the docs write as the user sees them: ~/.cache/hf_stable → the test's cache; <tiny-llama-...> → the
    built entry."""
    out = []
    for arg in argv:
        arg = arg.replace("~/.cache/hf_stable", str(cache))
        m = re.search(r"<([\w.-]+?)-\.\.\.>", arg)
        if m:
            head = Path(arg[: m.start()])
            entries = sorted(head.glob(f"{m.group(1)}-*"))
            assert entries, f"nothing matches {arg} (the shared run builds it)"
            arg = arg.replace(m.group(0), entries[0].name)
        out.append(arg)
    return out


def _run(argv: list[str], cwd: Path, cache: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(cache), capture_output=True, text=True, timeout=timeout, check=False)


def _launch(cmd: Command) -> list[str]:
    """The documented launch with the step cap appended; `accelerate` / `python` from this interpreter's venv."""
    i = cmd.argv.index("scripts/finetune.py")
    launcher = cmd.argv[:i]
    if launcher[:1] == ["accelerate"]:
        launcher = _executable("accelerate") + launcher[1:]
    else:
        launcher = [sys.executable]
    return [*launcher, "scripts/finetune.py", *cmd.script_args, *STEP_CAP]


def _assert_finished(proc: subprocess.CompletedProcess, out: Path) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["train_steps"] == 2 and not (out / "RUN_INCOMPLETE.json").exists()
    return summary


DEFAULT_LAUNCH = "accelerate launch scripts/finetune.py"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, cache_dir) -> Path:
    """The README's first launch, run once (with the step cap): the export and audit commands read its output."""
    work = _workdir(tmp_path_factory.mktemp("docs_run"))
    proc = _run(_launch(classify(DEFAULT_LAUNCH)), work, cache_dir)
    _assert_finished(proc, work / "outputs/default")
    return work


_RECIPE_RUNS: dict[str, Path] = {}  # a launch documented twice (README and a guide) runs once


def _check_recipe_run(cmd: Command, command: str, request, tmp_path: Path, cache: Path) -> None:
    if command == DEFAULT_LAUNCH:
        work = request.getfixturevalue("default_run")
    elif command in _RECIPE_RUNS:
        work = _RECIPE_RUNS[command]
    else:
        # the default run builds the tiny Llama base once, before any other launch needs it; a later stage
        # (stage: grpo / dpo) starts from the default run's output dir, so it runs where that run is
        default_work = request.getfixturevalue("default_run")
        work = default_work if _recipe_config(cmd.script_args).model.start_from else _workdir(tmp_path / "work")
        proc = _run(_launch(cmd), work, cache)
        _assert_finished(proc, work / _recipe_config(cmd.script_args).training["output_dir"])
        _RECIPE_RUNS[command] = work
    cfg = _recipe_config(cmd.script_args)
    out = work / cfg.training["output_dir"]
    assert (out / "adapter_model.safetensors").is_file() and (out / "generation_config.json").is_file()
    if cfg.export.merged:
        check = json.loads((out / "merged" / "export_check.json").read_text())
        assert check["passed"] is True, check


_CLI_RUNS: dict[str, subprocess.CompletedProcess] = {}  # a command documented twice (README and a guide) runs once


def _check_cli(cmd: Command, request, cache: Path) -> None:
    work = request.getfixturevalue("default_run")
    argv = _placeholders(cmd.argv, cache)
    key = shlex.join(argv)
    if key not in _CLI_RUNS:
        _CLI_RUNS[key] = _run(_executable("hf-stable") + argv[1:], work, cache)
    proc = _CLI_RUNS[key]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    if "--json" in argv:
        json.loads(proc.stdout)
    if argv[1] == "export":
        run_dir = work / argv[2]
        merged = work / argv[argv.index("--out") + 1] if "--out" in argv else run_dir / "merged"
        check = json.loads((merged / "export_check.json").read_text())
        assert check["passed"] is True, check
        if "--dtype" in argv:
            assert check["dtype"] == argv[argv.index("--dtype") + 1], check


def _check_recipe_validates(cmd: Command) -> None:
    cfg = _recipe_config(cmd.script_args)  # raises ConfigError on an unknown key, a wrong type or a bad value
    assert cfg.model.name_or_path
    if cmd.launch_config is not None:
        launch = yaml.safe_load((ROOT / cmd.launch_config).read_text(encoding="utf-8"))
        assert isinstance(launch, dict) and launch.get("compute_environment"), cmd.launch_config


def _check_make(cmd: Command) -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in cmd.argv[1:]:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), f"no make target {target!r}"
    if cmd.argv[1:] == ["demo"]:  # make demo is the default launch the shared run makes
        recipe = re.search(r"^demo:.*?\n((?:\t.*\n)+)", makefile, re.MULTILINE).group(1)
        assert "accelerate launch" in recipe and recipe.rstrip().endswith("scripts/finetune.py"), recipe


def _check_pytest(cmd: Command, request) -> None:
    markers = {m.split(":")[0] for m in request.config.getini("markers")}
    for i, arg in enumerate(cmd.argv[1:], start=1):
        if arg.startswith("tests/"):
            assert (ROOT / arg.split("::")[0]).is_file(), arg
        if cmd.argv[i - 1] == "-m":
            assert arg in markers, arg


def _check_pip(cmd: Command) -> None:
    section = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[project.optional-dependencies]")[1]
    extras = re.findall(r"^([\w-]+) = \[", section.split("\n[")[0], re.MULTILINE)  # tomllib: Python >= 3.11 only
    for arg in cmd.argv[2:]:
        m = re.fullmatch(r"hf-stable\[([\w,-]+)\]", arg)
        assert m, arg
        assert set(m.group(1).split(",")) <= set(extras), arg


def _check_generator(cmd: Command) -> None:
    assert cmd.argv[3:] == [">", "docs/CONFIG.md"], cmd.argv
    proc = subprocess.run(
        [sys.executable, "-m", "hf_stable.config.reference"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert proc.stdout == (ROOT / "docs/CONFIG.md").read_text(encoding="utf-8"), "docs/CONFIG.md is stale"


@pytest.mark.parametrize("where,line,command", _params())
def test_documented_commands(where, line, command, request, tmp_path, cache_dir):
    cmd = classify(command)
    if cmd.kind == "recipe-run":
        _check_recipe_run(cmd, command, request, tmp_path, cache_dir)
    elif cmd.kind == "cli":
        _check_cli(cmd, request, cache_dir)
    elif cmd.kind == "recipe-validate":
        _check_recipe_validates(cmd)
    elif cmd.kind == "make":
        _check_make(cmd)
    elif cmd.kind == "pytest":
        _check_pytest(cmd, request)
    elif cmd.kind == "pip":
        _check_pip(cmd)
    elif cmd.kind == "generator":
        _check_generator(cmd)
    else:
        assert (ROOT / cmd.argv[-1]).is_file() and "test_committed_dataset_matches_generator" in (
            ROOT / "tests/test_embedded.py"
        ).read_text(encoding="utf-8")


# --- Links -----------------------------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _without_code(text: str) -> str:
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def heading_slugs(path: Path) -> set[str]:
    slugs: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _without_code(path.read_text(encoding="utf-8")), re.MULTILINE):
        slug = github_slug(m.group(1))
        n = slugs.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        slugs[slug] = n + 1
    return out


def relative_links() -> list[tuple[str, str]]:
    found = []
    for path in doc_files():
        text = re.sub(r"`[^`\n]*`", "", _without_code(path.read_text(encoding="utf-8")))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                found.append((_rel(path), target))
    return found


def test_docs_link_to_each_other():
    links = relative_links()
    assert len(links) > 30 and any(t.startswith("docs/") for w, t in links if w == "README.md")


def test_relative_links_resolve():
    broken = []
    for where, target in relative_links():
        file, _, anchor = target.partition("#")
        path = (ROOT / where).parent / file if file else ROOT / where
        if not path.exists():
            broken.append(f"{where}: {target} - no such file")
        elif anchor and (path.suffix != ".md" or anchor not in heading_slugs(path)):
            broken.append(f"{where}: {target} - no heading with that anchor in {path.name}")
    assert not broken, "\n".join(broken)


def test_github_slugs():
    assert github_slug("Engines: what runs under DDP, FSDP2 and DeepSpeed ZeRO") == (
        "engines-what-runs-under-ddp-fsdp2-and-deepspeed-zero"
    )
    assert github_slug("`grad_norm` is NaN, None, or different across engines") == (
        "grad_norm-is-nan-none-or-different-across-engines"
    )
    assert github_slug("The run stops at once with `error:`") == "the-run-stops-at-once-with-error"
