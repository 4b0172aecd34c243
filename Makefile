# The two setup commands of the README. Both work on a fresh machine (no venv, no torch):
#   make demo   - install, then run the main job on the embedded default (offline, CPU)
#   make test   - install, then run the test suite
#   make demo-grpo - the demo's SFT run (skipped when outputs/default holds it), then the GRPO stage from its adapter
# For the inner loop:
#   make test-fast - the suite without subprocess recipe runs, 2-process, DeepSpeed and wheel tests (~2 min on 2 cores: 865 tests)
#   make lint      - ruff's rules and formatting, checked (`ruff check --fix .` / `ruff format .` apply them)
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

# two pytest-xdist workers, a test file each at a time (its module fixtures run once); one torch thread per worker
# (tests/conftest.py). `make test WORKERS=` runs in one process.
WORKERS ?= -n 2 --dist loadfile
FAST := not slow and not distributed and not deepspeed and not wheel

.PHONY: setup demo demo-grpo test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e ".[dev,deepspeed,bitsandbytes]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		scripts/finetune.py

# SFT -> GRPO on the embedded default; the last line says exact match per family before and after the GRPO stage
demo-grpo: setup
	test -f outputs/default/run_summary.json || $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 \
		--mixed_precision no --dynamo_backend no scripts/finetune.py
	$(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		scripts/finetune.py --config configs/grpo.yaml --runtime.overwrite true

test: setup
	$(VENV)/bin/python -m pytest -q $(WORKERS)

test-fast: setup
	$(VENV)/bin/python -m pytest -q $(WORKERS) -m "$(FAST)"

# Both checks run and both report; the target fails if either found something.
lint: setup
	@status=0; $(VENV)/bin/ruff check . || status=1; $(VENV)/bin/ruff format --check . || status=1; exit $$status

bench: setup
	$(VENV)/bin/python benchmarks/packing.py
	$(VENV)/bin/python benchmarks/monitor_overhead.py
	$(VENV)/bin/python benchmarks/attention.py
	$(VENV)/bin/python benchmarks/rescue.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
