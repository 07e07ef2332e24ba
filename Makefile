# trainstack developer commands. `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# The pinned torch (tests/test_containers.py checks it against pyproject.toml [tool.trainstack], the Dockerfile
# and apptainer.def).
TORCH_VERSION ?= 2.13.0
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROCS ?= 2
PYTEST_ARGS ?=
SLURM_CONF_PATH := /tmp/trainstack-slurm/slurm.conf

.PHONY: help venv install bytecode run test test-slow test-ci test-fast test-dist test-driver test-slurm test-gpu gpu-check gpu-wheels lint lint-hpc typecheck bench bench-smoke \
        bench-peers bench-gpu bench-slurm bench-recovery bench-memory bench-store bench-compile bench-llm bench-startup image-test image-gpu docs docs-serve slurm-up slurm-down run-multinode render-examples wheel docker-build docker-run \
        apptainer-build nccl-check clean

help:  ## list targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e '.[dev]'
	@# bytecode for everything installed, once: where PYTHONDONTWRITEBYTECODE=1 is set (some CI images), every
	@# process would otherwise compile torch's Python again (~2.6 s per process that imports torch._dynamo)
	@# (a few packages ship files for other Python versions that do not compile: not an error here)
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	@touch $@

bytecode: $(VENV)/.installed  ## compile trainstack's own source (an editable install) where PYTHONDONTWRITEBYTECODE=1
	@# is set: otherwise every process (each relaunch of a recovery, each worker) compiles it again, ~0.15 s each
	@$(PY) -m compileall -q trainstack >/dev/null

venv install: $(VENV)/.installed  ## create .venv and install torch + trainstack[dev]

run: $(VENV)/.installed bytecode  ## demo: train on $(NPROCS) CPU processes (gloo)
	$(PY) examples/demo.py --nprocs $(NPROCS)

test: $(VENV)/.installed bytecode  ## the suite (unit, distributed, real Slurm when available) but the slow cluster tests
	$(PY) -m pytest -m "not bench and not slow" $(PYTEST_ARGS)

test-slow: $(VENV)/.installed bytecode  ## the slow tests (whole Slurm workflows, requeues, examples): CI runs them too
	$(PY) -m pytest -m "slow and not bench" $(PYTEST_ARGS)

test-ci: $(VENV)/.installed bytecode  ## CI's tests: make test + make test-slow + bench-smoke, the real-Slurm group beside the rest, then the timing tests alone
	scripts/test-ci.sh $(PYTEST_ARGS)

test-fast: $(VENV)/.installed  ## unit tests only (no process spawning, no Slurm)
	$(PY) -m pytest -m "not distributed and not slurm and not slow" $(PYTEST_ARGS)

test-dist: $(VENV)/.installed  ## multi-process gloo tests
	$(PY) -m pytest -m distributed $(PYTEST_ARGS)

gpu-check:  ## the whole GPU lane in one call, one report (scripts/gpu-check.sh; a dry run without CUDA)
	PYTHON=$(if $(wildcard $(PY)),$(PY),python3) scripts/gpu-check.sh $(GPU_CHECK_REPORT)

gpu-wheels: $(VENV)/.installed  ## wheels a stock PyTorch GPU image lacks (.whl/, torchao versions in .whl-ao/, torchtitan in .whl-tt/)
	$(PY) -m pip wheel -q --no-deps -w .whl "python-hostlist>=1.23"
	for v in 0.18.0 0.17.0 0.16.0 0.15.0 0.14.1; do $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 -d .whl-ao/$$v torchao==$$v; done
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .whl-tt/0.3.0 torchtitan==0.3.0

test-gpu: $(VENV)/.installed  ## the GPU lane (tests/gpu; skipped without CUDA, part of make test when CUDA is present)
	$(PY) -m pytest tests/gpu -m gpu -rs $(PYTEST_ARGS)

test-slurm: $(VENV)/.installed slurm-up  ## tests on the local 3-node Slurm (node1-3)
	SLURM_CONF=$(SLURM_CONF_PATH) $(PY) -m pytest -m slurm $(PYTEST_ARGS)

lint: $(VENV)/.installed lint-hpc  ## ruff, the import contracts and graph, the structural checks, the size ceiling, lint-hpc
	$(PY) -m ruff check trainstack tests examples bench scripts
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/importgraph.py --fail-on-cycle --torch-free
	$(PY) scripts/structure.py
	$(PY) scripts/sizes.py --max-class 400 --max-function 60 --warn-class 360 --warn-module 630
	$(PY) scripts/reference_pages.py --check
	$(MAKE) --no-print-directory test-driver

DRIVER_VENV ?= build/venv-driver
DRIVER_WORKERS ?= 8
$(DRIVER_VENV)/.installed:
	@test -x $(DRIVER_VENV)/bin/python || $(PYTHON) -m venv $(DRIVER_VENV)
	$(DRIVER_VENV)/bin/python -m pip install -q click jinja2 rich python-hostlist pytest pytest-timeout pytest-xdist
	@# this checkout on its path (as an editable install would put it, without torch): the fake job steps import it
	$(DRIVER_VENV)/bin/python -c 'import site, sys; open(site.getsitepackages()[0] + "/trainstack-src.pth", "w").write(sys.argv[1])' "$(CURDIR)"
	@touch $@

test-driver: $(DRIVER_VENV)/.installed  ## the allocation driver's tests in a venv without torch (the CLI's dependencies only)
	@! $(DRIVER_VENV)/bin/python -c "import torch" 2>/dev/null || { echo "torch is installed in $(DRIVER_VENV)"; exit 1; }
	@# the scenarios mostly wait (grace windows, probes): several at once keep the run near 10 s on 2 cores
	$(DRIVER_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(DRIVER_WORKERS) tests/test_allocation.py

docs: $(VENV)/.installed  ## build the documentation site strictly into build/site (a broken link fails)
	$(PY) scripts/reference_pages.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: $(VENV)/.installed  ## serve the documentation at http://127.0.0.1:8000 while you edit it
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

typecheck: $(VENV)/.installed  ## mypy over the package (settings in pyproject.toml)
	$(PY) -m mypy

slurm-up:  ## start a 3-node Slurm on this host (root; apt-get install slurm-wlm munge)
	scripts/slurm-local.sh up

slurm-down:  ## stop the local Slurm
	scripts/slurm-local.sh down

clean:  ## remove build outputs and run folders
	rm -rf build dist .pytest_cache runs logs qml_logs

MN_LAUNCHER ?= torchrun
run-multinode: $(VENV)/.installed slurm-up  ## demo on the local 3-node Slurm: 2 nodes x 2 CPU processes
	SLURM_CONF=$(SLURM_CONF_PATH) $(VENV)/bin/trainstack submit --setup multi-node --nodes 2 --cpu \
	  --procs-per-node 2 --launcher $(MN_LAUNCHER) --job-name demo-multinode --time 00:10:00 \
	  --venv $(CURDIR)/$(VENV) --wait -- examples/demo.py --nprocs 4

render-examples: $(VENV)/.installed  ## render the template matrix into build/scripts for eyeballing
	$(PY) scripts/render_matrix.py build/scripts

IMAGE ?= trainstack:$(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' trainstack/_common/version.py)
SIF ?= trainstack.sif
CONTAINER_ENGINE ?= docker
REVISION := $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)

define need_engine
	@command -v $(1) >/dev/null || { echo "error: '$(1)' not found. $(2)"; exit 1; }
endef

# CPU variant: the CPU torch index. DOCKER_BUILD_ARGS comes last, so it can override any of these (another
# BASE_IMAGE, --network host, a local TORCH_INDEX_URL: see scripts/image-lib.sh).
CPU_BUILD_ARGS := --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
DOCKER_BUILD_ARGS ?=
# The commit's time, not the clock: the same commit builds the same labels (and they sit in the last layer anyway).
CREATED := $(shell git log -1 --format=%cI 2>/dev/null || echo unknown)
VARIANT_TAG := $(if $(filter cpu,$(DOCKER_VARIANT)),-cpu)
BUILD_FLAGS = --build-arg TORCH_VERSION=$(TORCH_VERSION) --build-arg REVISION=$(REVISION) --build-arg CREATED=$(CREATED) \
  $(if $(filter cpu,$(DOCKER_VARIANT)),$(CPU_BUILD_ARGS)) $(DOCKER_BUILD_ARGS)

# Two builds: the image up to its runtime stage, then the labelled stage with the CUDA/NCCL versions the first one
# recorded (/opt/trainstack/build-args.txt): the labels are read from the image, and the second build is seconds.
docker-build:  ## build the GPU image (CPU: DOCKER_VARIANT=cpu; extra flags: DOCKER_BUILD_ARGS="--network host ...")
	$(call need_engine,$(CONTAINER_ENGINE),Install Docker (or set CONTAINER_ENGINE=podman); images cannot be built without an engine.)
	@$(CONTAINER_ENGINE) info >/dev/null 2>&1 || { echo "error: the $(CONTAINER_ENGINE) daemon is not running (only the client is installed?)."; exit 1; }
	$(CONTAINER_ENGINE) build --target runtime -t $(IMAGE)$(VARIANT_TAG) $(BUILD_FLAGS) .
	$(CONTAINER_ENGINE) build -t $(IMAGE)$(VARIANT_TAG) $(BUILD_FLAGS) \
	  $$($(CONTAINER_ENGINE) run --rm --network none --entrypoint cat $(IMAGE)$(VARIANT_TAG) /opt/trainstack/build-args.txt) .

docker-run:  ## run the demo in the image (GPU when available)
	$(call need_engine,$(CONTAINER_ENGINE),Install Docker (or set CONTAINER_ENGINE=podman).)
	$(CONTAINER_ENGINE) run --rm --shm-size=1g $(if $(filter cpu,$(DOCKER_VARIANT)),,--gpus all) $(IMAGE)$(VARIANT_TAG)

image-test: $(VENV)/.installed  ## CI: own dockerd, local base image, build the CPU image, train + resume inside it
	scripts/ci-image.sh

image-gpu: $(VENV)/.installed  ## build the GPU image here (no GPU needed), check it inside, report size and build times
	scripts/image-gpu.sh

wheel: $(VENV)/.installed  ## build the project wheel into dist/
	$(PIP) wheel -q --no-deps --wheel-dir dist .

# Default: from the Docker image built by docker-build (apptainer.def, Bootstrap: docker-daemon). STANDALONE=1:
# apptainer-standalone.def, straight from the CUDA base image without Docker.
apptainer-build:  ## build trainstack.sif from the local Docker image (STANDALONE=1: without Docker)
	$(call need_engine,apptainer,Install Apptainer (https://apptainer.org/docs/admin/main/installation.html) on the build host.)
ifeq ($(STANDALONE),1)
	$(MAKE) wheel
	apptainer build --fakeroot --build-arg TORCH_VERSION=$(TORCH_VERSION) $(SIF) apptainer-standalone.def
else
	apptainer build --fakeroot --build-arg IMAGE=$(IMAGE)$(VARIANT_TAG) $(SIF) apptainer.def
endif

NCCL_CHECK_ARGS ?= --setup multi-node --nodes 2 --launcher torchrun
nccl-check: $(VENV)/.installed  ## all_reduce/barrier sanity job through the generated scripts (single node: NCCL_CHECK_ARGS=--setup multi-gpu)
	$(call need_engine,sbatch,nccl-check submits a Slurm job: run it on a login node (or make slurm-up + NCCL_CHECK_ARGS+=--cpu).)
	$(VENV)/bin/trainstack submit $(NCCL_CHECK_ARGS) --job-name nccl-check --time 00:10:00 --wait -- -m trainstack.nccl_check

lint-hpc: $(VENV)/.installed  ## hadolint, the def-file validator, shellcheck over the rendered template matrix
	$(VENV)/bin/hadolint --config .hadolint.yaml Dockerfile
	$(PY) scripts/defcheck.py apptainer.def apptainer-standalone.def
	shellcheck -s bash scripts/*.sh tests/containers/*.sh
	$(PY) scripts/render_matrix.py build/scripts >/dev/null
	shellcheck -s bash -S style build/scripts/*.sbatch

bench: $(VENV)/.installed  ## vs a raw DDP loop (and HF Accelerate / Lightning Fabric if installed), start-up per N, restart, FSDP
	$(PY) bench/run.py $(BENCH_ARGS)
	$(PY) bench/startup.py
	$(PY) bench/time_to_result.py
	$(PY) bench/restart.py
	$(PY) bench/fsdp.py

bench-startup: $(VENV)/.installed bytecode  ## time to result: first optimizer step and whole short run vs raw (two harnesses)
	$(PY) bench/startup.py
	$(PY) bench/time_to_result.py

bench-slurm: $(VENV)/.installed slurm-up  ## local Slurm: snapshot size/time, submit -> first log line vs plain sbatch
	$(PY) bench/slurm_workflow.py $(BENCH_ARGS)

bench-recovery: $(VENV)/.installed bytecode slurm-up  ## local Slurm: fault -> first resumed step (crash, spare, requeue)
	$(PY) bench/recovery.py $(BENCH_ARGS)

bench-memory: $(VENV)/.installed  ## memory checkpoints: the stall per save vs a synchronous durable save
	$(PY) bench/memory_checkpoints.py $(BENCH_ARGS)

bench-store: $(VENV)/.installed  ## checkpoints in an object store (a local S3 server) vs local disk: save/restore
	$(PY) bench/checkpoint_store.py $(BENCH_ARGS)

bench-gpu: $(VENV)/.installed  ## one GPU: raw vs Accelerator vs Trainer.fit vs peers (steps/s, syncs/step, memory)
	$(PY) bench/gpu.py $(BENCH_ARGS)

bench-llm: $(VENV)/.installed  ## a Llama-shaped decoder (1b, 8b-proxy): tokens/s, TFLOP/s, MFU by formula; raw vs Trainer.fit
	$(PY) bench/llm.py $(BENCH_ARGS)

bench-compile: $(VENV)/.installed  ## torch.compile: raw compiled loop vs Trainer(compile=True), first step cold vs warm cache
	$(PY) bench/compile.py $(BENCH_ARGS)

bench-smoke: $(VENV)/.installed  ## a few steps of every benchmark, end to end (CI runs it; make test does not)
	$(PY) -m pytest -m bench tests/test_bench.py $(PYTEST_ARGS)

bench-peers: $(VENV)/.installed  ## install the peers for the comparison (keeps the pinned torch)
	$(PIP) install -q "torch==$(TORCH_VERSION)" -e '.[bench]'
