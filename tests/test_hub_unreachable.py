"""A Hub that cannot be reached: the recipe stops in one line naming model.name_or_path and the ways out, within
30 s and without retries; the doctor says the same and still checks the data files and estimates memory; a cached
model loads from the cache. The network failure is real: HF_ENDPOINT points at a local port nobody listens on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

WAYS_OUT = "ways out: set model.name_or_path to a local model directory"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


def unreachable_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HOME=str(tmp_path / "hf_home"), **extra)
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def run(argv: list[str], env: dict, cwd) -> tuple[subprocess.CompletedProcess, float]:
    started = time.time()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    return proc, time.time() - started


@pytest.mark.slow
def test_the_recipe_fails_fast_in_one_line_naming_model_name_or_path(tmp_path):
    argv = [sys.executable, str(ROOT / "scripts" / "finetune.py"), "--config", "configs/qwen2.5-0.5b-lora.yaml"]
    argv += ["--training.bf16", "false", "--training.output_dir", str(tmp_path / "out")]  # bf16: a CPU machine
    proc, seconds = run(argv, unreachable_env(tmp_path), ROOT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert seconds < 30, seconds
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: model.name_or_path: cannot reach the Hugging Face Hub at http://127.0.0.1:"
    )
    assert "'Qwen/Qwen2.5-0.5B-Instruct', and it is not in the local cache" in errors[0]
    assert WAYS_OUT in errors[0] and "HF_HUB_OFFLINE=1" in errors[0] and "hf download" in errors[0]
    assert "Traceback" not in log and "Retrying in" not in log and "model.tokenizer" not in log


@pytest.mark.slow
def test_the_doctor_names_the_hub_checks_the_data_and_estimates_memory(tmp_path):
    """`hf-stable doctor --config configs/qwen2.5-7b-qlora.yaml` with the Hub out of reach, from a directory without
    the config's data/my_dataset/: one Hub row with the ways out (no "report this"), the missing data file named,
    and the memory estimate from the shapes hf_stable ships."""
    config = str(ROOT / "configs" / "qwen2.5-7b-qlora.yaml")
    argv = [sys.executable, "-m", "hf_stable.cli", "doctor", "--config", config, "--json", "--no-dry-run"]
    proc, seconds = run(argv, unreachable_env(tmp_path), tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert seconds < 30, seconds
    findings = json.loads(proc.stdout)["findings"]
    hub = [f for f in findings if "Hugging Face Hub" in f["what"]]
    assert len(hub) == 1 and hub[0]["severity"] == "error" and hub[0]["what"].startswith("model.name_or_path: ")
    assert hub[0]["fix"].startswith(WAYS_OUT)
    assert not [f for f in findings if "report this" in (f.get("fix") or "")]
    data = [f for f in findings if f["check"] == "hazards.data" and f["severity"] == "error"]
    assert [f["what"] for f in data] == ["data.train_file cannot be read", "data.eval_file cannot be read"]
    assert "data/my_dataset/train.jsonl does not exist" in data[0]["evidence"]
    memory = [f for f in findings if f["check"] == "hazards.memory_estimate"]
    assert len(memory) == 1 and memory[0]["what"].startswith("estimated training memory ")
    assert "Retrying in" not in proc.stderr and "Traceback" not in proc.stderr


def fake_cache(hf_home, repo: str) -> str:
    """A Hub cache entry holding only config.json (the layout huggingface_hub writes)."""
    commit = "0" * 40
    entry = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(snapshot)


RESOLVE = "from hf_stable.hub import resolve_hub_model; print('->', resolve_hub_model('someone/cached-model'))"


def test_a_cached_model_loads_from_the_cache_when_the_hub_is_down(tmp_path):
    env = unreachable_env(tmp_path)
    snapshot = fake_cache(tmp_path / "hf_home", "someone/cached-model")
    proc, _ = run([sys.executable, "-c", RESOLVE], env, ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == f"-> {snapshot}"
    assert "cannot be reached" in proc.stderr and "loading someone/cached-model from the local cache" in proc.stderr


def test_offline_mode_without_the_model_cached_says_so_in_one_line(tmp_path):
    proc, _ = run([sys.executable, "-c", RESOLVE], unreachable_env(tmp_path, HF_HUB_OFFLINE="1"), ROOT)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "model.name_or_path: HF_HUB_OFFLINE=1 and 'someone/cached-model' is not in the " in last
    assert WAYS_OUT in last


def test_every_hub_model_of_configs_has_its_shape_shipped():
    """The doctor's memory estimate without the Hub: each Hub id in configs/ has a shipped shape whose parameter
    count is the model's published size."""
    import yaml

    from hf_stable.doctor.probes import meta_model_from_config, shipped_shape

    published = {"Qwen/Qwen2.5-7B-Instruct": 7.62e9, "Qwen/Qwen2.5-0.5B-Instruct": 0.494e9}
    published["meta-llama/Llama-3.1-8B-Instruct"] = 8.03e9
    names = set()
    for path in (ROOT / "configs").glob("*.yaml"):
        name = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("name_or_path", "")
        if "/" in name and not name.startswith("embedded:"):
            names.add(name)
    assert names == set(published)
    for name, size in published.items():
        n = sum(p.numel() for p in meta_model_from_config(shipped_shape(name)).parameters())
        assert abs(n - size) / size < 0.01, (name, n)
    assert shipped_shape("someone/unknown") is None
