#!/usr/bin/env bash
# Build the project's CPU image from the repository's own Dockerfile and train inside it (CI; root; Debian host).
#
#   scripts/ci-image.sh            # make image-test runs this
#   TRAINSTACK_CI_SLURM_GATE=FILE  # CI: build and test in the image beside the test lanes, the Slurm part once FILE
#                                  # exists (the tests no longer use the local Slurm)
#
# What this machine needs and users never do lives here, not in the Dockerfile:
#   * no registry: the base image is made with debootstrap (--variant=minbase bookworm) + docker import, with the
#     host's extra CA certificates added and PIP_CERT set, and a uid-1000 user as ubuntu:24.04 has one;
#   * PyPI's torch wheels are CUDA builds: the host's CPU wheel (/opt/wheels) is served from a local simple index
#     (TORCH_INDEX_URL), otherwise the official CPU index is used.
# It starts its own dockerd (own socket, by pid) and stops it on exit. Then, inside the image: labels, trainstack
# doctor, the 2-process demo as uid 1000, examples/classification.py writing under /workspace, checkpoint -> resume
# into a bind-mounted folder as uid 1000, a warm rebuild with a new revision (cache check), and the generated
# apptainer script run through the local Slurm (scripts/slurm-local.sh up) with docker standing in for apptainer.
# Timings and the image size go to $STATE/image-report.json.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STATE=${TRAINSTACK_CI_STATE:-/var/tmp/trainstack-ci-image}
DATA_ROOT=${TRAINSTACK_DOCKER_ROOT:-/var/lib/trainstack-docker}
BASE=trainstack-ci-base:bookworm
IMAGE=trainstack:ci-cpu
TORCH_VERSION=$(sed -n 's/^TORCH_VERSION ?= //p' Makefile)
export DOCKER_HOST="unix://$STATE/docker.sock"
mkdir -p "$STATE"

log() { printf '\n=== ci-image: %s\n' "$*"; }
fail() { printf 'ci-image: FAILED: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

# ---- tools ---------------------------------------------------------------------------------------------------
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [[ ${#need[@]} -gt 0 ]]; then
  log "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
DOCKER=/usr/bin/docker; [[ -x $DOCKER ]] || DOCKER=$(command -v docker)

# ---- our own dockerd, stopped on exit ------------------------------------------------------------------------
SERVER_PID=""
cleanup() {
  if [[ -n $SERVER_PID ]]; then kill "$SERVER_PID" 2>/dev/null || true; fi
  if [[ -s $STATE/dockerd.pid ]]; then
    pid=$(cat "$STATE/dockerd.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT
if [[ -s $STATE/dockerd.pid ]] && kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null; then
  kill "$(cat "$STATE/dockerd.pid")"; sleep 2
fi
log "dockerd (data root $DATA_ROOT)"
dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=overlay2 \
  --host "$DOCKER_HOST" --pidfile "$STATE/dockerd.pid" --data-root "$DATA_ROOT" --exec-root "$STATE/exec" \
  >"$STATE/dockerd.log" 2>&1 &
for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.5; done
"$DOCKER" info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log"; fail "dockerd did not start"; }

# ---- the base image ------------------------------------------------------------------------------------------
T0=$(now)
if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
  mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\/\{0,1\}\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  log "debootstrap bookworm from $mirror"
  rootfs="$STATE/rootfs"
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$mirror" >"$STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$STATE/debootstrap.log"; fail "debootstrap"; }
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
  chroot "$rootfs" update-ca-certificates >/dev/null
  chroot "$rootfs" useradd --create-home --uid 1000 ubuntu  # as ubuntu:24.04 and the CUDA images have
  rm -rf "$rootfs/var/cache/apt/archives"/*.deb "$rootfs/var/lib/apt/lists"/*
  tar -C "$rootfs" -c . | "$DOCKER" import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_EXTRA_INDEX_URL=https://pypi.org/simple' \
    --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
fi
BASE_S=$(since "$T0")

# ---- torch: the local CPU wheel through a local simple index --------------------------------------------------
wheel=$(find /opt/wheels -maxdepth 1 -name "torch-$TORCH_VERSION+cpu-*.whl" 2>/dev/null | head -1 || true)
if [[ -n $wheel ]]; then
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
else
  TORCH_INDEX=https://download.pytorch.org/whl/cpu
fi

# ---- build through the Makefile, cold then warm ----------------------------------------------------------------
build() {  # $1: revision label
  make --no-print-directory docker-build DOCKER_VARIANT=cpu IMAGE=trainstack:ci CONTAINER_ENGINE="$DOCKER" \
    REVISION="$1" DOCKER_BUILD_ARGS="--network host --build-arg BASE_IMAGE=$BASE --build-arg TORCH_INDEX_URL=$TORCH_INDEX"
}
if [[ ${TRAINSTACK_CI_COLD:-1} == 1 ]]; then
  "$DOCKER" image rm -f "$IMAGE" >/dev/null 2>&1 || true
  "$DOCKER" builder prune -af >/dev/null 2>&1 || true
  "$DOCKER" image prune -f >/dev/null 2>&1 || true
fi
log "cold build"
T0=$(now); build "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"; COLD_S=$(since "$T0")
before=$("$DOCKER" image inspect --format '{{json .RootFS.Layers}}' "$IMAGE")
log "warm build with a new revision (must hit the cache up to the labels)"
T0=$(now); build ci-warm-check; WARM_S=$(since "$T0")
after=$("$DOCKER" image inspect --format '{{json .RootFS.Layers}}' "$IMAGE")
[[ $before == "$after" ]] || fail "a new revision changed filesystem layers (labels must come last)"
SIZE_MB=$(( $("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE") / 1000000 ))

# ---- inside the image ------------------------------------------------------------------------------------------
label() { "$DOCKER" image inspect --format "{{index .Config.Labels \"$1\"}}" "$IMAGE"; }
[[ $(label cuda.version) == none && $(label nccl.version) == none ]] || fail "CPU image labels: cuda=$(label cuda.version) nccl=$(label nccl.version)"
[[ $(label org.opencontainers.image.revision) == ci-warm-check ]] || fail "revision label not updated"
[[ $("$DOCKER" image inspect --format '{{.Config.User}}' "$IMAGE") == 1000:1000 ]] || fail "image does not run as uid 1000"

run() { "$DOCKER" run --rm --network none --shm-size=1g "$@"; }
log "trainstack doctor"
run "$IMAGE" trainstack doctor
log "the 2-process demo (CMD, uid 1000)"
T0=$(now); demo=$(run "$IMAGE" 2>&1) || { echo "$demo"; fail "demo"; }; DEMO_S=$(since "$T0")
echo "$demo" | tail -3
grep -q "final loss" <<<"$demo" || fail "demo printed no final loss"
log "examples/classification.py writes runs/ under /workspace as uid 1000"
run "$IMAGE" python examples/classification.py --epochs 1 --samples 256 | tail -2
log "checkpoint -> resume into a bind-mounted folder as uid 1000"
work=$(mktemp -d "$STATE/resume.XXXX")
cp tests/containers/resume_job.py "$work/"
chown -R 1000:1000 "$work"
first=$(run -v "$work:/job" -w /job "$IMAGE" python resume_job.py --folder runs/r --epochs 2 2>&1) \
  || { echo "$first"; fail "first run"; }
second=$(run -v "$work:/job" -w /job "$IMAGE" python resume_job.py --folder runs/r --epochs 4 2>&1) \
  || { echo "$second"; fail "resumed run"; }
echo "$second" | grep -E "Continuing at|end_epoch"
grep -Eq "Continuing at += epoch 2, step 8" <<<"$second" || fail "the second run did not resume at epoch 2"
grep -q '"end_epoch": 4, "step": 16' <<<"$second" || fail "the resumed run did not finish epoch 4 at step 16"
owners=$(find "$work/runs" -printf '%u\n' | sort -u | tr '\n' ' ')
[[ $owners == "1000 " || $owners == "$(getent passwd 1000 | cut -d: -f1) " ]] || fail "files not owned by uid 1000: $owners"

# ---- the generated apptainer script through Slurm, docker standing in for apptainer -----------------------------
SLURM_JOB="skipped (no local Slurm)"
if [[ -n ${TRAINSTACK_CI_SLURM_GATE:-} ]]; then  # CI builds the image beside the tests: Slurm is theirs until then
  log "waiting for $TRAINSTACK_CI_SLURM_GATE (the tests' use of the local Slurm ends)"
  while [[ ! -e $TRAINSTACK_CI_SLURM_GATE ]]; do sleep 2; done
fi
if [[ -n ${SLURM_CONF:-} ]] && command -v sbatch >/dev/null && scontrol ping >/dev/null 2>&1; then
  log "generated --container apptainer script on the local 2-node Slurm (docker run as apptainer)"
  job=$(mktemp -d "$STATE/slurm.XXXX")
  mkdir -p "$job/bin"
  sed "s|@DOCKER@|$DOCKER|; s|@IMAGE@|$IMAGE|; s|@DOCKER_HOST@|$DOCKER_HOST|" tests/containers/apptainer-via-docker.sh \
    >"$job/bin/apptainer"
  chmod +x "$job/bin/apptainer"
  cp examples/demo.py "$job/"
  touch "$job/trainstack.sif"
  (cd "$job" && PATH="$job/bin:$PATH" "$ROOT/.venv/bin/trainstack" generate --setup multi-node --nodes 2 \
     --procs-per-node 2 --cpu --launcher torchrun --container apptainer --image "$job/trainstack.sif" \
     --bind "$job:$job" --job-name ci-image --time 00:05:00 -o job.sbatch -- demo.py --epochs 3)
  T0=$(now)
  (cd "$job" && PATH="$job/bin:$PATH" sbatch --wait job.sbatch) || { cat "$job"/logs/*.out; fail "Slurm job"; }
  SLURM_S=$(since "$T0")
  out=$(cat "$job"/logs/*.out)
  grep -q "training on 4 process(es)" <<<"$out" || { echo "$out"; fail "the job did not train on 4 processes"; }
  grep -q "in-container: /opt/trainstack/versions.json" <<<"$out" || { echo "$out"; fail "not run in the image"; }
  SLURM_JOB="2 nodes x 2 processes in the image, ${SLURM_S}s"
  echo "$SLURM_JOB"
fi

cat >"$STATE/image-report.json" <<EOF
{"base_image_s": $BASE_S, "cold_build_s": $COLD_S, "warm_build_s": $WARM_S, "image_mb": $SIZE_MB,
 "demo_s": $DEMO_S, "slurm": "$SLURM_JOB"}
EOF
log "ok: $(cat "$STATE/image-report.json")"
