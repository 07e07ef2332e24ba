#!/usr/bin/env bash
# Build the GPU image from the repository's own Dockerfile on this machine (no GPU, no registry: the CUDA torch wheels
# come from the package index) and check inside it what can be checked without a GPU.
#
#   scripts/image-gpu.sh              # make image-gpu: cold build (cache pruned), warm rebuild, checks, report
#   TRAINSTACK_CI_COLD=0 scripts/image-gpu.sh   # keep the build cache (seconds instead of minutes)
#   TRAINSTACK_IMAGE_GPU_MAX_MB=7000  # the size goal, checked (uncompressed, as `docker image inspect` counts it)
#
# Checked inside (tests/containers/image_checks.py, as uid 1000, no network): torch's CUDA and NCCL versions against
# /opt/trainstack/versions.json and the labels, each CUDA library present once (no second CUDA runtime or cuDNN),
# no libcuda baked in, the libraries NCCL's IB transport loads, the pip constraints, gcc + Python headers for
# Triton, the container-toolkit variables, the non-root user, /workspace writable, trainstack doctor.
# The report (sizes next to the CPU image's when it was built here) goes to $STATE/image-gpu-report.json.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${TRAINSTACK_IMAGE_STATE:-/var/tmp/trainstack-image-gpu}
# shellcheck source=scripts/image-lib.sh
source scripts/image-lib.sh
MAX_MB=${TRAINSTACK_IMAGE_GPU_MAX_MB:-7000}

image_tools
image_dockerd
T0=$(now); image_base; BASE_S=$(since "$T0")
image_build_cold_warm gpu ""
image_checks "$IMAGE"

log "sizes"
"$DOCKER" history --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | awk -F'\t' '$1 !~ /^0B$/ {print $1 "\t" substr($2, 1, 110)}'
# shellcheck disable=SC2016  # expanded inside the container (one du each: du -s counts a folder once)
parts=$("$DOCKER" run --rm --network none "$IMAGE" bash -c 'cd /opt/venv/lib/python3*/site-packages &&
  for d in /opt/venv nvidia torch triton; do du -sm "$d" | cut -f1; done | paste -sd" "')
read -r VENV_MB NVIDIA_MB TORCH_MB TRITON_MB <<<"$parts"
BASE_MB=$(( $("$DOCKER" image inspect --format '{{.Size}}' "$BASE") / 1000000 ))
CPU_MB=null
if "$DOCKER" image inspect trainstack:ci-cpu >/dev/null 2>&1; then
  CPU_MB=$(( $("$DOCKER" image inspect --format '{{.Size}}' trainstack:ci-cpu) / 1000000 ))
fi
versions=$("$DOCKER" run --rm --network none "$IMAGE" cat /opt/trainstack/versions.json)
cat >"$STATE/image-gpu-report.json" <<JSON
{"image": "$IMAGE", "versions": $versions, "base_image_s": $BASE_S, "cold_build_s": $COLD_S,
 "warm_build_s": $WARM_S, "image_mb": $SIZE_MB, "base_mb": $BASE_MB, "venv_mb": $VENV_MB,
 "nvidia_wheels_mb": $NVIDIA_MB, "torch_mb": $TORCH_MB, "triton_mb": $TRITON_MB, "cpu_image_mb": $CPU_MB,
 "goal_mb": $MAX_MB}
JSON
log "report: $(cat "$STATE/image-gpu-report.json")"
[[ $SIZE_MB -le $MAX_MB ]] || fail "the GPU image is $SIZE_MB MB, over the $MAX_MB MB goal"
log "ok"
