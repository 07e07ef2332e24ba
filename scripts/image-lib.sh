#!/usr/bin/env bash
# Shared by scripts/ci-image.sh (the CPU image, CI) and scripts/image-gpu.sh (the GPU image): build the repository's
# Dockerfile on a machine with no registry and no GPU. Sourced, never run; the caller sets STATE (a folder) first.
#
# What this machine needs and users never do lives here, not in the Dockerfile:
#   * our own dockerd (own socket and data root, by pid), stopped on exit;
#   * no registry: the base image is made with debootstrap (--variant=minbase bookworm) + docker import, with the
#     host's extra CA certificates added and PIP_CERT set, and a uid-1000 user as ubuntu:24.04 has one;
#   * the CPU variant: PyPI's torch wheels are CUDA builds, so the host's CPU wheel (/opt/wheels) is served from a
#     local simple index (TORCH_INDEX_URL), otherwise the official CPU index is used.
# shellcheck shell=bash disable=SC2034  # (IMAGE, COLD_S, WARM_S, SIZE_MB are the callers')

DATA_ROOT=${TRAINSTACK_DOCKER_ROOT:-/var/lib/trainstack-docker}
BASE=trainstack-ci-base:bookworm
TORCH_VERSION=$(sed -n 's/^TORCH_VERSION ?= //p' Makefile)
export DOCKER_HOST="unix://$STATE/docker.sock"
mkdir -p "$STATE"

log() { printf '\n=== %s: %s\n' "$(basename "$0" .sh)" "$*"; }
fail() { printf '%s: FAILED: %s\n' "$(basename "$0" .sh)" "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

image_tools() {  # docker and debootstrap from the distribution when missing
  local need=()
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  if [[ ${#need[@]} -gt 0 ]]; then
    log "apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
  DOCKER=/usr/bin/docker; [[ -x $DOCKER ]] || DOCKER=$(command -v docker)
}

SERVER_PID=""
image_cleanup() {
  if [[ -n $SERVER_PID ]]; then kill "$SERVER_PID" 2>/dev/null || true; fi
  if [[ -s $STATE/dockerd.pid ]]; then
    local pid; pid=$(cat "$STATE/dockerd.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
  fi
}

image_dockerd() {  # our own dockerd on $STATE/docker.sock; one data root (and so one build cache) for both scripts
  trap image_cleanup EXIT
  # our own left-over goes; the other image script's dockerd on the same data root must finish first
  if [[ -s $STATE/dockerd.pid ]] && kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null; then
    kill "$(cat "$STATE/dockerd.pid")"; sleep 2
  fi
  local other
  for other in /var/tmp/trainstack-*/dockerd.pid; do
    if [[ $other != "$STATE/dockerd.pid" && -s $other ]] && kill -0 "$(cat "$other")" 2>/dev/null; then
      fail "a dockerd from $(dirname "$other") is running on $DATA_ROOT (pid $(cat "$other")): let it finish or kill it"
    fi
  done
  log "dockerd (data root $DATA_ROOT)"
  dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=overlay2 \
    --host "$DOCKER_HOST" --pidfile "$STATE/dockerd.pid" --data-root "$DATA_ROOT" --exec-root "$STATE/exec" \
    >"$STATE/dockerd.log" 2>&1 &
  for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.5; done
  "$DOCKER" info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log"; fail "dockerd did not start"; }
}

image_base() {  # the registry-free base image $BASE (debootstrap, once per data root)
  if "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then return; fi
  local mirror rootfs="$STATE/rootfs"
  mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\/\{0,1\}\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  log "debootstrap bookworm from $mirror"
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$mirror" >"$STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$STATE/debootstrap.log"; fail "debootstrap"; }
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
  chroot "$rootfs" update-ca-certificates >/dev/null
  chroot "$rootfs" useradd --create-home --uid 1000 ubuntu  # as ubuntu:24.04 has
  rm -rf "$rootfs/var/cache/apt/archives"/*.deb "$rootfs/var/lib/apt/lists"/*
  tar -C "$rootfs" -c . | "$DOCKER" import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_EXTRA_INDEX_URL=https://pypi.org/simple' \
    --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
}

image_cpu_index() {  # sets TORCH_INDEX for the CPU variant: the host's CPU wheel through a local simple index
  local wheel index port href
  wheel=$(find /opt/wheels -maxdepth 1 -name "torch-$TORCH_VERSION+cpu-*.whl" 2>/dev/null | head -1 || true)
  TORCH_INDEX=https://download.pytorch.org/whl/cpu
  [[ -n $wheel ]] || return 0
  index="$STATE/index"
  rm -rf "$index"; mkdir -p "$index/simple/torch"
  ln -s "$wheel" "$index/$(basename "$wheel")"
  href=$(basename "$wheel" | sed 's/+/%2B/')
  printf '<html><body><a href="../../%s">%s</a></body></html>\n' "$href" "$(basename "$wheel")" \
    >"$index/simple/torch/index.html"
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" >"$STATE/index.log" 2>&1 &
  SERVER_PID=$!
  TORCH_INDEX="http://127.0.0.1:$port/simple"
}

# image_build_cold_warm VARIANT(cpu|gpu) EXTRA_BUILD_ARGS: a cold build (cache pruned unless TRAINSTACK_CI_COLD=0)
# of trainstack:ci[-cpu], then a warm one with a new revision that must not change a filesystem layer. Sets IMAGE,
# COLD_S, WARM_S, SIZE_MB.
image_build_cold_warm() {
  local variant=$1 extra=$2 before after image=trainstack:ci flavour=""
  if [[ $variant == cpu ]]; then image=trainstack:ci-cpu; flavour=cpu; fi
  IMAGE=$image
  build() {
    make --no-print-directory docker-build DOCKER_VARIANT="$flavour" IMAGE=trainstack:ci \
      CONTAINER_ENGINE="$DOCKER" REVISION="$1" DOCKER_BUILD_ARGS="--network host --build-arg BASE_IMAGE=$BASE $extra"
  }
  if [[ ${TRAINSTACK_CI_COLD:-1} == 1 ]]; then
    "$DOCKER" image rm -f "$image" >/dev/null 2>&1 || true
    "$DOCKER" builder prune -af >/dev/null 2>&1 || true
    "$DOCKER" image prune -f >/dev/null 2>&1 || true
  fi
  log "cold build of $image"
  local t0; t0=$(now); build "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"; COLD_S=$(since "$t0")
  before=$("$DOCKER" image inspect --format '{{json .RootFS.Layers}}' "$image")
  log "warm build with a new revision (must hit the cache up to the labels)"
  t0=$(now); build ci-warm-check; WARM_S=$(since "$t0")
  after=$("$DOCKER" image inspect --format '{{json .RootFS.Layers}}' "$image")
  [[ $before == "$after" ]] || fail "a new revision changed filesystem layers (labels must come last)"
  SIZE_MB=$(( $("$DOCKER" image inspect --format '{{.Size}}' "$image") / 1000000 ))
}

image_label() { "$DOCKER" image inspect --format "{{index .Config.Labels \"$2\"}}" "$1"; }

# image_checks IMAGE: what can be checked inside without a GPU (tests/containers/image_checks.py, as uid 1000 with
# no network), then the labels against the versions the image records.
image_checks() {
  local image=$1 versions
  [[ $("$DOCKER" image inspect --format '{{.Config.User}}' "$image") == 1000:1000 ]] || fail "$image does not run as uid 1000"
  [[ $(image_label "$image" org.opencontainers.image.revision) == ci-warm-check ]] || fail "revision label not updated"
  log "checks inside $image"
  "$DOCKER" run --rm --network none -v "$PWD/tests/containers/image_checks.py:/tmp/image_checks.py:ro" "$image" \
    python /tmp/image_checks.py || fail "in-image checks"
  versions=$("$DOCKER" run --rm --network none "$image" cat /opt/trainstack/versions.json)
  python3 - "$versions" "$(image_label "$image" cuda.version)" "$(image_label "$image" nccl.version)" \
    "$(image_label "$image" torch.version)" <<'PY' || fail "labels"
import json, sys
v, cuda, nccl, torch = json.loads(sys.argv[1]), *sys.argv[2:]
assert cuda == (v["cuda"] or "none") and nccl == (v["nccl"] or "none"), (v, cuda, nccl)
assert v["torch"].split("+")[0] == torch, (v, torch)
print(f"labels agree with the image: torch {torch}, cuda {cuda}, nccl {nccl}")
PY
}
