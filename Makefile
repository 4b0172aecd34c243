# The two setup commands of the README. Both work on a fresh machine (no venv, no torch):
#   make demo   - install, then run the main job on the embedded default (offline, CPU)
#   make test   - install, then run the test suite
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e ".[dev,deepspeed]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		scripts/finetune.py

test: setup
	$(VENV)/bin/python -m pytest -q

bench: setup
	$(VENV)/bin/python benchmarks/packing.py
	$(VENV)/bin/python benchmarks/monitor_overhead.py
	$(VENV)/bin/python benchmarks/attention.py
	$(VENV)/bin/python benchmarks/rescue.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
