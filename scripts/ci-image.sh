#!/usr/bin/env bash
# Build the project's CPU image from the repository's own Dockerfile and train inside it (CI; root; Debian host).
#
#   scripts/ci-image.sh            # make image-test runs this
#   TRAINSTACK_CI_SLURM_GATE=FILE  # CI: build and test in the image beside the test lanes, the Slurm part once FILE
#                                  # exists (the tests no longer use the local Slurm)
#
# The registry-free base, our own dockerd and the local CPU torch index: scripts/image-lib.sh. Inside the image:
# labels, trainstack doctor, the 2-process demo as uid 1000, examples/classification.py writing under /workspace,
# checkpoint -> resume into a bind-mounted folder as uid 1000, a warm rebuild with a new revision (cache check), and
# the generated apptainer script through the local Slurm (scripts/slurm-local.sh up) with docker standing in for
# apptainer: 2 nodes x 2 processes, every one of them inside the image (each process records its node and Python),
# checkpoint under torchrun, resume under srun. Timings and the image size go to $STATE/image-report.json.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STATE=${TRAINSTACK_CI_STATE:-/var/tmp/trainstack-ci-image}
# shellcheck source=scripts/image-lib.sh
source scripts/image-lib.sh
# shellcheck source=scripts/gate.sh
source scripts/gate.sh

image_tools
image_dockerd
T0=$(now); image_base; BASE_S=$(since "$T0")
image_cpu_index
image_build_cold_warm cpu "--build-arg TORCH_INDEX_URL=$TORCH_INDEX"
image_checks "$IMAGE"

# ---- inside the image ------------------------------------------------------------------------------------------
[[ $(image_label "$IMAGE" cuda.version) == none && $(image_label "$IMAGE" nccl.version) == none ]] \
  || fail "CPU image labels: cuda=$(image_label "$IMAGE" cuda.version) nccl=$(image_label "$IMAGE" nccl.version)"

run() { "$DOCKER" run --rm --network none --shm-size=1g "$@"; }
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
  gate_wait 3600 || fail "the test lane never said it was done with the local Slurm"
fi
if [[ -n ${SLURM_CONF:-} ]] && command -v sbatch >/dev/null && scontrol ping >/dev/null 2>&1; then
  log "every process of a 2-node job inside the image: the generated --container apptainer scripts on the local Slurm"
  job=$(mktemp -d "$STATE/slurm.XXXX")
  mkdir -p "$job/bin"
  sed "s|@DOCKER@|$DOCKER|; s|@IMAGE@|$IMAGE|; s|@DOCKER_HOST@|$DOCKER_HOST|" tests/containers/apptainer-via-docker.sh \
    >"$job/bin/apptainer"
  chmod +x "$job/bin/apptainer"
  cp tests/containers/resume_job.py "$job/"
  touch "$job/trainstack.sif"
  slurm_run() {  # $1: launcher, $2: epochs, $3: tag -- one generated job, waited for
    (cd "$job" && PATH="$job/bin:$PATH" "$ROOT/.venv/bin/trainstack" generate --setup multi-node --nodes 2 \
       --procs-per-node 2 --cpu --launcher "$1" --container apptainer --image "$job/trainstack.sif" \
       --bind "$job:$job" --job-name "ci-image-$3" --time 00:05:00 -o "$3.sbatch" -- \
       resume_job.py --folder runs/multi --epochs "$2" --nprocs 4 --records records --tag "$3")
    (cd "$job" && PATH="$job/bin:$PATH" sbatch --wait "$3.sbatch") || { cat "$job"/logs/*"$3"*.out >&2; fail "Slurm job $3"; }
    cat "$job"/logs/ci-image-"$3"-*.out
  }
  T0=$(now)
  first=$(slurm_run torchrun 2 first)
  second=$(slurm_run srun 4 second)
  SLURM_S=$(since "$T0")
  grep -Eq "Continuing at +=? *epoch 2" <<<"$second" || { echo "$second"; fail "the srun job did not resume the torchrun job's checkpoint"; }
  grep -q '"end_epoch": 4' <<<"$second" || { echo "$second"; fail "the resumed job did not finish epoch 4"; }
  python3 - "$job/records" <<'PY' || { echo "$first"; echo "$second"; fail "a process ran outside the image"; }
import json, sys
from pathlib import Path
for tag in ("first", "second"):
    records = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob(f"{tag}-rank*.json"))]
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3], (tag, records)
    outside = [r for r in records if not r["in_image"] or r["prefix"] != "/opt/venv"]
    assert not outside, f"{tag}: processes on the host's Python: {outside}"
    nodes = sorted({r["node"] for r in records})
    assert len(nodes) == 2, f"{tag}: all processes on {nodes}: the other node never entered the image"
    print(f"{tag}: ranks 0-3 inside the image (prefix /opt/venv) on {', '.join(nodes)}")
PY
  SLURM_JOB="2 nodes x 2 processes, all inside the image: checkpoint under torchrun, resume under srun, ${SLURM_S}s"
  echo "$SLURM_JOB"
fi

cat >"$STATE/image-report.json" <<EOF
{"base_image_s": $BASE_S, "cold_build_s": $COLD_S, "warm_build_s": $WARM_S, "image_mb": $SIZE_MB,
 "demo_s": $DEMO_S, "slurm": "$SLURM_JOB"}
EOF
log "ok: $(cat "$STATE/image-report.json")"
