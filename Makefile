# fleetrl: the two commands are `make demo` and `make test`; both set themselves up.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
CONFORMANCE_STAMP := $(VENV)/.installed-conformance
# Installs into a venv that already holds SGLang's and vLLM's code (installed without their
# GPU dependencies on purpose) skip pip's report of those missing dependencies; what each
# install itself brings is still resolved and checked.
NO_WARN := --no-warn-conflicts
# torch and torchvision as the matching pair SGLang 0.5.23 pins (torch 2.14.1);
# an unpinned torch would pull whatever is newest. It runs on the CPU here.
TORCH  ?= torch==2.14.1 torchvision==0.29.1
# The SGLang release(s) the conformance tier tests against; on CPU its Python
# code is installed without its GPU dependencies (tests/conformance/requirements-cpu.txt).
SGLANG ?= sglang==0.5.23
# The vLLM release the vLLM conformance tier tests against: its Python code goes into the
# venv without dependencies; what it needs that would clash with SGLang's pins goes into
# $(VENV)/vllm-overlay, which only the vLLM tier's processes put first on their path. Not
# byte-compiled at install (--no-compile): the tier imports a small part of vLLM's 547 MB,
# compiled on first import; compiling it all took 1.5 of the 3 install minutes here.
VLLM   ?= vllm==0.34.0
# The Ray every cluster route runs (configs/cluster/*.yaml pin the same release).
RAY    ?= ray[default]==2.60.0
# The image's extras: sglang for GPU rollout and reward nodes (the product image); empty
# for an image without SGLang.
IMAGE_EXTRAS ?= sglang
IMAGE_TAG    ?=
DEMO_OUT ?= runs/demo/run
DEMO_RM_OUT ?= runs/demo/rm
DEMO_RLHF_OUT ?= runs/demo/rlhf
DEMO_ELASTIC_OUT ?= runs/demo/elastic
DEMO_AGENT ?= runs/demo/agent
# More `key=value` overrides for the run of make demo, demo-rlhf or demo-agent, after its own:
# make demo OVERRIDES="trainer.total_steps=10"
OVERRIDES ?=
# More flags for the agent demo's builder (examples/agents/build_calculator_demo.py --help);
# they apply when it builds, that is when $(DEMO_AGENT)/model does not exist yet.
AGENT_BUILD_ARGS ?=

.PHONY: demo demo-rm demo-rlhf demo-elastic demo-agent wheel image test-deploy test test-unit test-integration test-e2e test-conformance lint format bench docs clean venv gpu-check device-bundle device-check

venv: $(STAMP) $(CONFORMANCE_STAMP)

# What the demos and the product need: torch and fleetrl with its extras. One line per step
# says what is installed and why; pip itself stays quiet (-q).
$(STAMP): pyproject.toml
	@echo "venv: Python virtualenv in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "venv: $(TORCH): the pair SGLang pins; the index serves torch's CUDA build (3.2 GB of libraries), which runs on a CPU as well"
	$(PY) -m pip install -q $(TORCH)
	@echo "venv: fleetrl (editable) with its dev, tensorboard, mlflow and agent extras"
	PYTHONWARNINGS=ignore $(PY) -m pip install -q $(NO_WARN) -e ".[dev,tensorboard,mlflow,agent]"
	$(PY) -m fleetrl.bytecode
	touch $(STAMP)

# What the conformance tier tests against (make test installs it; the demos do not need it):
# SGLang's and vLLM's own Python code, without their GPU dependencies. The pure-Python
# packages their import chains need go in first, the two releases last with --no-deps, so
# pip has nothing to report about the GPU packages it deliberately leaves out.
$(CONFORMANCE_STAMP): $(STAMP) tests/conformance/requirements-cpu.txt tests/conformance/vllm/requirements-cpu.txt
	@echo "venv: $(SGLANG) and $(VLLM), their Python code only (no GPU dependencies), for tests/conformance"
	$(PY) -m pip install -q $(NO_WARN) -r tests/conformance/requirements-cpu.txt
	$(PY) -m pip install -q --no-deps "$(SGLANG)"
	$(PY) -m pip install -q --no-deps --no-compile "$(VLLM)"
	$(PY) -m pip install -q --no-deps --no-compile --upgrade --target $(VENV)/vllm-overlay -r tests/conformance/vllm/requirements-cpu.txt
	touch $(CONFORMANCE_STAMP)

# The `bench` extra (TRL, the vs-trl suite's baseline): make test and make bench install it.
$(BENCH_STAMP): $(STAMP)
	@echo "venv: the bench extra (TRL $(shell sed -n 's/.*"trl==\([0-9.]*\)".*/\1/p' pyproject.toml), the vs-trl baseline)"
	PYTHONWARNINGS=ignore $(PY) -m pip install -q $(NO_WARN) -e ".[bench]"
	touch $(BENCH_STAMP)

# The demo run starts afresh each time (the tiny model and data it built are reused);
# fleetrl's modules changed since the install are compiled first (fleetrl/bytecode.py).
demo: $(STAMP)
	$(PY) -m fleetrl.bytecode
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/fleetrl train --config configs/demo_cpu.yaml trainer.output_dir=$(DEMO_OUT) $(OVERRIDES)

# The RLHF demo's reward model (docs/rewards_training.md), afresh; then how it ranks the
# warm-started policy's own samples against the rule it was labelled by.
demo-rm: $(STAMP)
	rm -rf $(DEMO_RM_OUT)
	$(VENV)/bin/fleetrl rm train --config configs/demo_rm_cpu.yaml trainer.output_dir=$(DEMO_RM_OUT)
	$(VENV)/bin/fleetrl rm eval --model $(DEMO_RM_OUT)/reward_model --policy runs/demo/add2/model \
		--prompts runs/demo/add2/data/test.parquet --rule configs/rules/even_answer.py --max-new-tokens 4

# The RLHF demo's RL half (configs/demo_rlhf_cpu.yaml): GRPO on the reward model's score
# alone, scored by a reward server the run places; the reward model first if there is none.
demo-rlhf: $(STAMP)
	test -f $(DEMO_RM_OUT)/reward_model/config.json || $(MAKE) demo-rm
	rm -rf $(DEMO_RLHF_OUT)
	$(VENV)/bin/fleetrl train --config configs/demo_rlhf_cpu.yaml trainer.output_dir=$(DEMO_RLHF_OUT) \
		reward.model.path=$(DEMO_RM_OUT)/reward_model $(OVERRIDES)

# The demo with an elastic fleet, 100 steps: one engine, three after step 3 (fleetrl fleet
# scale), one again after step 25 once they served (scripts/demo_elastic.py; figures in
# docs/cluster.md), afresh.
demo-elastic: $(STAMP)
	rm -rf $(DEMO_ELASTIC_OUT)
	env -u RAY_ADDRESS $(PY) scripts/demo_elastic.py --out $(DEMO_ELASTIC_OUT)

# The agent demo (configs/demo_agent_cpu.yaml): an agent program written against OpenAI's API
# is the rollout; GRPO teaches the tiny model to call its calculator tool right. The data and
# the warm-started model are built once; the run starts afresh each time.
demo-agent: $(STAMP)
	$(PY) examples/agents/build_calculator_demo.py --out $(DEMO_AGENT) $(AGENT_BUILD_ARGS)
	rm -rf $(DEMO_AGENT)/run
	$(VENV)/bin/fleetrl train --config configs/demo_agent_cpu.yaml trainer.output_dir=$(DEMO_AGENT)/run \
		model.path=$(DEMO_AGENT)/model data.train_files=[$(DEMO_AGENT)/data/train.parquet] \
		data.val_files=[$(DEMO_AGENT)/data/test.parquet] $(OVERRIDES)

# Each tier in a fresh interpreter, the fast one first: one tier's process state (loaded
# libraries, their caches and patches) never reaches another's; every tier runs, then the
# status says whether all passed. Each tier names its ten slowest tests (the suite's hour).
TIERS := unit conformance integration e2e cluster
# The unit and integration tiers run TEST_WORKERS tests side by side (pytest-xdist; 0: one
# at a time): their tests spend much of their time waiting on processes they start, so a
# second one fills the idle core (on 2 cores: unit 415 s -> 218-271 s, integration 974 s ->
# 690 s). The others run one test at a time: e2e's training runs keep both cores busy (two
# side by side took as long as one after the other), and the cluster tier shares one Slurm.
TEST_WORKERS ?= 2
PARALLEL_TIERS := unit integration

# tests/cluster drives a real Slurm (slurm-wlm, munge): installed here with apt-get, or its
# tests skip, one line each.
test: $(CONFORMANCE_STAMP) $(BENCH_STAMP) lint
	@bash scripts/test_tools.sh slurm-wlm:slurmctld munge:munged
	@status=0; for tier in $(TIERS); do \
		echo "== tests/$$tier"; \
		case " $(PARALLEL_TIERS) " in *" $$tier "*) side="-n $(TEST_WORKERS) --dist worksteal";; *) side="";; esac; \
		env -u RAY_ADDRESS $(PY) -m pytest -q --durations=10 $$side tests/$$tier || status=1; \
	done; exit $$status

test-unit: $(CONFORMANCE_STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(CONFORMANCE_STAMP) $(BENCH_STAMP)
	env -u RAY_ADDRESS $(PY) -m pytest -q tests/integration

test-e2e: $(CONFORMANCE_STAMP) $(BENCH_STAMP)
	env -u RAY_ADDRESS $(PY) -m pytest -q tests/e2e

# SGLang's own HTTP server and weight-update code on CPU (tests/conformance/sglang_engine)
test-conformance: $(CONFORMANCE_STAMP)
	$(PY) -m pytest -q tests/conformance

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP) $(BENCH_STAMP)
	$(VENV)/bin/fleetrl bench all --quick --out runs/bench

# On a machine with a GPU and this virtualenv: every stage of the GPU check on CUDA (the SGLang
# stages too where SGLang is installed); report in runs/gpu_check/gpu_check.json. On a GPU
# machine without a package registry (one H200, Python 3.12, torch 2.11; see docs/gpu_check.md),
# which cannot install anything: `bash scripts/device/gpu_check.sh` with .device-bundle carried.
gpu-check: $(STAMP)
	env -u RAY_ADDRESS $(PY) scripts/gpu_check.py --device cuda --out runs/gpu_check --work runs/gpu_check_work

# What that GPU machine lacks (ray, pyzmq, msgspec for Python 3.12), packed into
# .device-bundle/ to travel with the working tree; prints the sizes (kept when up to date).
device-bundle: $(STAMP)
	$(PY) scripts/device/bundle.py

# The GPU check proven on the CPU before it runs on a GPU (CI runs this beside `make test`): the
# bundle installs for Python 3.12 and Ray starts from it, and every stage of
# scripts/gpu_check.py runs at tiny sizes with what the GPU machine lacks refused.
device-check: device-bundle
	env -u RAY_ADDRESS $(PY) -m pytest -q -m device_check tests

# This checkout as a wheel, alone in dist/: what configs/cluster/aws.yaml ships to every node.
wheel: $(STAMP)
	rm -rf dist
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist .

# The image (docker/Dockerfile) with docker, podman or buildah, whichever is here; its heavy
# layer is reused while requirements are unchanged, the Debian base made from Debian's
# packages where none can be pulled (docker/build_image.py, cache in .image-cache/).
image: $(STAMP)
	$(PY) docker/build_image.py --extras "$(IMAGE_EXTRAS)" $(if $(IMAGE_TAG),--tag "$(IMAGE_TAG)") \
		$(foreach p,$(TORCH) $(RAY),--pin "$(p)")

# What downloads gigabytes (CI runs it after `make test`): the image built and the demo
# trained inside it, and the SGLang node types of configs/cluster/aws.yaml installed.
test-deploy: $(STAMP)
	@bash scripts/test_tools.sh buildah:buildah mmdebstrap:mmdebstrap
	env -u RAY_ADDRESS $(PY) -m pytest -q -m deploy tests/cluster

docs: $(STAMP)
	$(VENV)/bin/fleetrl config docs --out docs/configuration.md
	$(VENV)/bin/fleetrl config docs --verl --out docs/verl.md

clean:
	rm -rf $(VENV) runs dist .pytest_cache .ruff_cache .device-bundle .device-cache .image-cache
