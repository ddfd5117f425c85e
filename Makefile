# fleetrl: the two commands are `make demo` and `make test`; both set themselves up.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch and torchvision as the matching pair SGLang 0.5.23 pins (torch 2.14.1);
# an unpinned torch would pull whatever is newest. It runs on the CPU here.
TORCH  ?= torch==2.14.1 torchvision==0.29.1
# The SGLang release(s) the conformance tier tests against; on CPU its Python
# code is installed without its GPU dependencies (tests/conformance/requirements-cpu.txt).
SGLANG ?= sglang==0.5.23
DEMO_OUT ?= runs/demo/run

.PHONY: demo test test-unit test-integration test-e2e test-conformance lint format bench docs clean venv gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml tests/conformance/requirements-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev,tensorboard,mlflow]"
	$(PY) -m pip install -q --no-deps "$(SGLANG)"
	$(PY) -m pip install -q -r tests/conformance/requirements-cpu.txt
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

# SGLang's own HTTP server and weight-update code on CPU (tests/conformance/sglang_engine)
test-conformance: $(STAMP)
	$(PY) -m pytest -q tests/conformance

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(VENV)/bin/fleetrl bench all --quick --out runs/bench

# On a machine with a GPU: a real SGLang server (tested release), logprobs against the
# learner, weight sync GB/s, 5 demo steps on CUDA; report in runs/gpu_check/gpu_check.json.
gpu-check: $(STAMP)
	$(PY) -m pip install -q -e ".[sglang]"
	env -u RAY_ADDRESS $(PY) scripts/gpu_check.py --out runs/gpu_check

docs: $(STAMP)
	$(VENV)/bin/fleetrl config docs --out docs/configuration.md
	$(VENV)/bin/fleetrl config docs --verl --out docs/verl.md

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
