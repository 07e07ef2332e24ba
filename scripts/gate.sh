#!/usr/bin/env bash
# The CI gate between the test lanes and the image lane: the image lane's Slurm part waits until no test uses the
# local Slurm any more. One helper writes it and one awaits it, with a timeout, so a lane that died never leaves the
# other waiting forever. Sourced, never run; the gate file is $TRAINSTACK_CI_SLURM_GATE (unset: no gate, no wait).
# shellcheck shell=bash

# Open the gate (the tests are done with the local Slurm; also when they failed).
gate_open() {
  if [[ -n ${TRAINSTACK_CI_SLURM_GATE:-} ]]; then touch "$TRAINSTACK_CI_SLURM_GATE"; fi
}

# Wait until the gate opens, at most $1 seconds (default 3600); non-zero, with a line saying so, on the timeout.
gate_wait() {
  local limit=${1:-3600} waited=0
  [[ -n ${TRAINSTACK_CI_SLURM_GATE:-} ]] || return 0
  while [[ ! -e $TRAINSTACK_CI_SLURM_GATE ]]; do
    if ((waited >= limit)); then
      echo "gate: $TRAINSTACK_CI_SLURM_GATE not opened within ${limit} s (did the test lane die?)" >&2
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
}
