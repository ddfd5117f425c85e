# fleetrl: the two commands are `make demo` and `make test`; both set themselves up.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch (an unpinned torch pulls a multi-GB CUDA build).
TORCH  ?= torch==2.13.0
DEMO_OUT ?= runs/demo/run

.PHONY: demo test test-unit test-integration test-e2e lint format bench docs clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,tensorboard]"
	touch $(STAMP)

# The demo run starts afresh each time (the tiny model and data it built are reused).
demo: $(STAMP)
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/fleetrl train --config configs/demo_cpu.yaml trainer.output_dir=$(DEMO_OUT)

test: $(STAMP) lint
	env -u RAY_ADDRESS $(PY) -m pytest -q tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	env -u RAY_ADDRESS $(PY) -m pytest -q tests/integration

test-e2e: $(STAMP)
	env -u RAY_ADDRESS $(PY) -m pytest -q tests/e2e

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(VENV)/bin/fleetrl bench all --quick --out runs/bench

docs: $(STAMP)
	$(VENV)/bin/fleetrl config docs --out docs/configuration.md

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
