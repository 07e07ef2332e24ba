#!/usr/bin/env bash
# CI's tests: everything `make test` and `make test-slow` run, plus the benchmarks' smoke runs, in about the time of
# the longer of two lanes run at once -- the real-Slurm tests (one at a time: they kill, pin and time the local
# cluster's nodes), then the tests that start clusters of their own, then bench-smoke, beside everything else (unit,
# gloo, the slow non-Slurm tests) -- and then the tests marked `alone` (they measure time or contention) with the
# machine to themselves. Each group's output goes to build/ci-<group>.log (its times to build/ci-<group>.xml) and
# is printed whole at the end, then a table of the groups' times. On CI's 2 cores a permutation of a path another
# test confirms is left to `make test` (tests/helpers.py: ci_leaves_out).
#
#   scripts/test-ci.sh [PYTEST ARGS...]     # make test-ci
#   TRAINSTACK_CI_SLURM_GATE=FILE           # touched when no test uses the local Slurm any more (the image test's
#                                           # Slurm part waits for it: scripts/ci-image.sh)
set -uo pipefail
# shellcheck source=scripts/gate.sh
source "$(dirname "$0")/gate.sh"
cd "$(dirname "$0")/.." || exit 2
PY=${PY:-.venv/bin/python}
mkdir -p build
args=(-p no:cacheprovider --durations=15 "$@")
GROUPS_RUN=(slurm clusters rest bench alone)

group() {  # NAME MARKERS [PYTEST ARGS...]: its log, and "status seconds" in build/ci-NAME.status
  local name=$1 marks=$2 started=$SECONDS code
  shift 2
  "$PY" -m pytest -m "$marks" "${args[@]}" --junitxml="build/ci-$name.xml" "$@" >"build/ci-$name.log" 2>&1
  code=$?
  echo "$code $((SECONDS - started))" >"build/ci-$name.status"
}

start=$SECONDS
rm -f build/ci-*.status
(  # the Slurm tests one at a time, then the tests that start clusters of their own (they need no quiet machine),
   # then the benchmarks' smoke runs (this lane is the shorter one)
  group slurm "slurm and not bench and not alone"
  group clusters "own_clusters and not slurm and not bench and not alone"
  group bench "bench" tests/test_bench.py
) &
slurm_pid=$!
group rest "not slurm and not own_clusters and not bench and not alone"
wait "$slurm_pid"
group alone "alone and not bench"
gate_open

status=0
table=()
for name in "${GROUPS_RUN[@]}"; do
  echo "=================================================================== group $name (build/ci-$name.log)"
  cat "build/ci-$name.log"
  read -r code seconds <"build/ci-$name.status" || { code=99; seconds=0; }
  ok=$([[ $code -eq 0 || $code -eq 5 ]] && echo ok || echo "FAILED ($code)")  # 5: nothing selected (no Slurm)
  [[ $ok == ok ]] || status=1
  table+=("$(printf '%-6s %5d s  %s' "$name" "$seconds" "$ok")")
done
echo "=== test groups (total $((SECONDS - start)) s; slurm, clusters then bench ran beside rest; alone last)"
printf '%s\n' "${table[@]}"
exit "$status"
