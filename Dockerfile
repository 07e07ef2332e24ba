# trainstack reference image: the same CUDA, PyTorch and NCCL on a laptop, a workstation and every cluster.
#   GPU: docker build -t trainstack:0.1.0 .
#   CPU: make docker-build DOCKER_VARIANT=cpu   (BASE_IMAGE=ubuntu:24.04, the CPU torch index, truthful labels)
# Every base image is a build arg; nothing here needs a registry beyond BASE_IMAGE and a Python package index.
# Versions come from pyproject.toml [tool.trainstack] (checked by tests/test_containers.py).
# Layer order is cache order: OS packages, torch, the project, then metadata (labels) last, so a new commit or
# build date never reinstalls apt packages or torch.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---- stage 1: OS packages and an empty venv, shared by the wheel build and the runtime ----------------------
# Labels belong to the final image only (hadolint counts a stage used by FROM as unlabelled).
# hadolint ignore=DL3049
FROM ${BASE_IMAGE} AS base
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
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# ---- stage 2: build the project wheel with the runtime's own Python (no torch, no CUDA needed) -------------
FROM base AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainstack ./trainstack
COPY templates ./templates
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# ---- stage 3: runtime --------------------------------------------------------------------------------------
FROM base AS runtime
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY --from=wheel /dist/ /tmp/wheels/
RUN pip install --no-cache-dir /tmp/wheels/trainstack-*.whl && rm -rf /tmp/wheels

# Build-time check: the versions that will actually run (pip torch ships its own NCCL), recorded in the image,
# and the labels below must tell the truth about them ("none" for a CPU build), or the build fails.
ARG CUDA_LABEL=12.8
ARG NCCL_LABEL=bundled-with-torch
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN mkdir -p /opt/trainstack \
 && python -c "import json, torch, trainstack; \
n = '.'.join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None; \
v = {'trainstack': trainstack.__version__, 'torch': torch.__version__, 'cuda': torch.version.cuda, 'nccl': n}; \
print(v); json.dump(v, open('/opt/trainstack/versions.json', 'w')); \
c, l, cu = '${CUDA_LABEL}', '${NCCL_LABEL}', v['cuda']; \
assert (cu is None) if c == 'none' else str(cu).startswith(c), ('cuda.version label', c, 'but torch CUDA is', cu); \
assert (n is None) if l == 'none' else (n is not None and l in ('bundled-with-torch', n)), ('nccl.version label', l, 'but torch NCCL is', n)"

# Non-root by default, and /workspace is theirs (runs/ and checkpoints are written there). Slurm and Apptainer run
# as the submitting user anyway, and `docker run --user` still works. Some bases (ubuntu:24.04 and the CUDA images
# built on it) already have a uid-1000 user: it is replaced.
RUN if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)"; fi \
 && useradd --create-home --uid 1000 --user-group --shell /bin/bash trainer \
 && install -d -o 1000 -g 1000 /workspace
WORKDIR /workspace
COPY --chown=1000:1000 examples ./examples
USER 1000:1000
CMD ["python", "examples/demo.py", "--nprocs", "2"]

# Metadata last: a new revision or date only changes this layer.
ARG TRAINSTACK_VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="trainstack" \
      org.opencontainers.image.description="PyTorch + NCCL runtime for trainstack jobs" \
      org.opencontainers.image.version="${TRAINSTACK_VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="https://github.com/trainstack/trainstack" \
      org.opencontainers.image.licenses="Apache-2.0" \
      torch.version="${TORCH_VERSION}" \
      cuda.version="${CUDA_LABEL}" \
      nccl.version="${NCCL_LABEL}"
