# trainstack reference image: the same CUDA, PyTorch and NCCL on a laptop, a workstation and every cluster.
#   GPU: make docker-build                          (a plain OS base + the CUDA torch wheels: CUDA present once)
#   CPU: make docker-build DOCKER_VARIANT=cpu       (the CPU torch index)
#   here, without a registry: make image-gpu / make image-test (a debootstrap base; scripts/image-gpu.sh)
# No nvidia/cuda base: the CUDA torch wheels bring the CUDA runtime, cuBLAS, cuDNN and NCCL themselves, so a CUDA
# base image would only hold a second copy of them. What pip never brings enters at run time: the driver (libcuda,
# by the container toolkit, `apptainer --nv` or the enroot hooks), the site's network plugin (aws-ofi-nccl: site
# hooks). Users who compile CUDA extensions build on a toolkit base instead, at the cost of that second copy:
#   make docker-build DOCKER_BUILD_ARGS="--build-arg BASE_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04"
# Every base image is a build arg; nothing here needs a registry beyond BASE_IMAGE and a Python package index.
# Versions come from pyproject.toml [tool.trainstack] (checked by tests/test_containers.py).
# Layer order is cache order: OS packages, torch, the project, then metadata (labels) last, so a new commit or
# build date never reinstalls apt packages or torch.
ARG BASE_IMAGE=ubuntu:24.04

# ---- stage 1: OS packages and an empty venv, shared by the wheel build and the runtime ----------------------
# Labels belong to the final image only (hadolint counts a stage used by FROM as unlabelled).
# hadolint ignore=DL3049
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# NVIDIA_*: what the container toolkit and the enroot hooks look for before they mount the driver (compute: libcuda,
# utility: nvidia-smi). RDMA user space (libibverbs, the mlx5/efa providers, librdmacm; ibv_devinfo to look): without
# it NCCL silently falls back to TCP sockets on InfiniBand/RoCE clusters. gcc and the Python headers: torch.compile
# builds Triton's launcher (GPU) and inductor's kernels (CPU) with them at run time.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ libc6-dev \
        ca-certificates procps iproute2 libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils \
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
# The CUDA torch wheels are the package index's own (PyPI: CUDA 13, needs a driver >= 580; older drivers:
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128). The constraints file pins what was installed with torch
# (torch, triton, the nvidia-*/cuda-* wheels: NCCL among them), so a user's `pip install` in the image cannot
# replace the tested stack (NGC images do the same).
# hadolint ignore=DL3049
FROM base AS runtime
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && mkdir -p /etc/pip \
 && pip freeze | grep -iE '^(torch|triton|nvidia-|cuda-)' > /etc/pip/constraint.txt \
 && cat /etc/pip/constraint.txt
ENV PIP_CONSTRAINT=/etc/pip/constraint.txt

COPY --from=wheel /dist/ /tmp/wheels/
RUN pip install --no-cache-dir /tmp/wheels/trainstack-*.whl && rm -rf /tmp/wheels

# The versions that will actually run (pip torch ships its own NCCL), recorded in the image; build-args.txt is
# what the labelled stage below is built with (make docker-build reads it back: the labels come from the image).
RUN mkdir -p /opt/trainstack \
 && python -c "import json, torch, trainstack; \
n = '.'.join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None; \
v = {'trainstack': trainstack.__version__, 'torch': torch.__version__, 'cuda': torch.version.cuda, 'nccl': n}; \
print(v); json.dump(v, open('/opt/trainstack/versions.json', 'w')); \
open('/opt/trainstack/build-args.txt', 'w').write(f\"--build-arg CUDA_LABEL={v['cuda'] or 'none'} --build-arg NCCL_LABEL={n or 'none'}\")"

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

# ---- stage 4: metadata last, so a new revision or date only changes these layers ----------------------------
# The labels must tell the truth about the versions the image records, or the build fails ("unstated" when built
# without make, which reads them back from build-args.txt).
FROM runtime AS labelled
ARG CUDA_LABEL=unstated
ARG NCCL_LABEL=unstated
RUN python -c "import json; v = json.load(open('/opt/trainstack/versions.json')); \
c, l, cu, n = '${CUDA_LABEL}', '${NCCL_LABEL}', v['cuda'], v['nccl']; \
assert c == 'unstated' or c == (cu or 'none'), ('cuda.version label', c, 'but torch CUDA is', cu); \
assert l == 'unstated' or l == (n or 'none'), ('nccl.version label', l, 'but torch NCCL is', n)"
ARG TORCH_VERSION=2.13.0
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
