# trainstack developer commands. `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Single source of truth for versions (checked by tests/test_versions.py against pyproject.toml,
# the Dockerfile and apptainer.def).
TORCH_VERSION ?= 2.13.0
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROCS ?= 2
PYTEST_ARGS ?=
SLURM_CONF_PATH := /tmp/trainstack-slurm/slurm.conf

.PHONY: help venv install run test test-fast test-dist test-slurm lint bench slurm-up slurm-down \
        run-multinode render-examples docker-build docker-run apptainer-build nccl-check clean

help:  ## list targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e '.[dev]'
	@touch $@

venv install: $(VENV)/.installed  ## create .venv and install torch + trainstack[dev]

run: $(VENV)/.installed  ## demo: train on $(NPROCS) CPU processes (gloo)
	$(PY) examples/demo.py --nprocs $(NPROCS)

test: $(VENV)/.installed  ## full suite (unit, distributed, real Slurm when available)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.installed  ## unit tests only (no process spawning, no Slurm)
	$(PY) -m pytest -m "not distributed and not slurm and not slow" $(PYTEST_ARGS)

test-dist: $(VENV)/.installed  ## multi-process gloo tests
	$(PY) -m pytest -m distributed $(PYTEST_ARGS)

test-slurm: $(VENV)/.installed slurm-up  ## tests on the local 2-node Slurm
	SLURM_CONF=$(SLURM_CONF_PATH) $(PY) -m pytest -m slurm $(PYTEST_ARGS)

lint: $(VENV)/.installed  ## ruff
	$(PY) -m ruff check trainstack tests examples bench

slurm-up:  ## start a 2-node Slurm on this host (root; apt-get install slurm-wlm munge)
	scripts/slurm-local.sh up

slurm-down:  ## stop the local Slurm
	scripts/slurm-local.sh down

clean:  ## remove build outputs and run folders
	rm -rf build dist .pytest_cache runs

MN_LAUNCHER ?= torchrun
run-multinode: $(VENV)/.installed slurm-up  ## demo on the local 2-node Slurm: 2 nodes x 2 CPU processes
	SLURM_CONF=$(SLURM_CONF_PATH) $(VENV)/bin/trainstack submit --setup multi-node --nodes 2 --cpu \
	  --procs-per-node 2 --launcher $(MN_LAUNCHER) --job-name demo-multinode --time 00:10:00 \
	  --venv $(CURDIR)/$(VENV) --wait -- examples/demo.py --nprocs 4

render-examples: $(VENV)/.installed  ## render the template matrix into build/scripts for eyeballing
	$(PY) scripts/render_matrix.py build/scripts
