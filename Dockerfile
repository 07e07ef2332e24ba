# syntax=docker/dockerfile:1.7
# trainstack reference image: the same CUDA, PyTorch and NCCL on a laptop, a workstation and every cluster.
#   GPU: docker build -t trainstack:0.1.0 .
#   CPU: docker build -t trainstack:0.1.0-cpu --build-arg BASE_IMAGE=ubuntu:24.04 \
#          --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
# Versions come from pyproject.toml [tool.trainstack] (checked by tests/test_containers.py).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---- stage 1: build the project wheel (no torch, no CUDA needed) -------------------------------------------
FROM python:3.12-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainstack ./trainstack
COPY templates ./templates
RUN pip install --no-cache-dir "pip==25.2" && pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# ---- stage 2: runtime --------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TRAINSTACK_VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG CUDA_LABEL=12.8
ARG NCCL_VERSION=""

LABEL org.opencontainers.image.title="trainstack" \
      org.opencontainers.image.description="PyTorch + NCCL runtime for trainstack jobs" \
      org.opencontainers.image.version="${TRAINSTACK_VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="https://github.com/trainstack/trainstack" \
      org.opencontainers.image.licenses="Apache-2.0" \
      torch.version="${TORCH_VERSION}" \
      cuda.version="${CUDA_LABEL}" \
      nccl.version="${NCCL_VERSION:-bundled-with-torch}"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# RDMA user-space libraries: without them NCCL silently falls back to TCP sockets on InfiniBand/RoCE clusters.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates procps iproute2 \
        libibverbs1 ibverbs-providers librdmacm1 \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv \
 && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY --from=wheel /dist/ /tmp/wheels/
RUN pip install --no-cache-dir /tmp/wheels/trainstack-*.whl && rm -rf /tmp/wheels

# Build-time check: the versions that will actually run (pip torch ships its own NCCL), recorded in the image.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN mkdir -p /opt/trainstack \
 && python -c "import json, torch, trainstack; \
n = '.'.join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None; \
v = {'trainstack': trainstack.__version__, 'torch': torch.__version__, 'cuda': torch.version.cuda, 'nccl': n}; \
print(v); json.dump(v, open('/opt/trainstack/versions.json', 'w'))" \
 && python -c "import torch, os; exp = os.environ.get('NCCL_EXPECTED', '${NCCL_VERSION}'); \
n = '.'.join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else ''; \
assert not exp or exp == n, f'NCCL {n} != NCCL_VERSION build arg {exp}'"

# Non-root by default; Slurm/Apptainer run as the submitting user anyway, and `docker run --user` still works.
RUN useradd --create-home --uid 1000 --shell /bin/bash trainer
WORKDIR /workspace
COPY --chown=trainer:trainer examples ./examples
USER 1000:1000

CMD ["python", "examples/demo.py", "--nprocs", "2"]
