#!/usr/bin/env bash
# `apptainer exec [--nv] [--bind SRC[:DST]]... IMAGE COMMAND...` carried out by `docker run`, for machines where
# Apptainer cannot be installed (scripts/ci-image.sh fills in @DOCKER@, @IMAGE@, @DOCKER_HOST@). Like Apptainer it
# keeps the host's network, process ids, user, working directory and environment (Slurm's variables reach the
# program). The host's pid namespace matters: torchrun's rendezvous tells agents apart by hostname + pid, and two
# containers of their own on one host both run torchrun as pid 7 (the two "nodes" here share a hostname).
set -euo pipefail
[[ ${1:-} == exec ]] || { echo "apptainer-via-docker: only 'exec' is supported, got: $*" >&2; exit 2; }
shift
mounts=(-v "$PWD:$PWD")
while [[ ${1:-} == --* ]]; do
  case $1 in
    --nv) shift ;;
    --bind) src=${2%%:*}; dst=${2#*:}; mounts+=(-v "$src:${dst:-$src}"); shift 2 ;;
    *) echo "apptainer-via-docker: unsupported flag $1" >&2; exit 2 ;;
  esac
done
[[ -e ${1:-} ]] || { echo "apptainer-via-docker: no image file ${1:-}" >&2; exit 2; }
shift
envs=()
while IFS= read -r name; do
  case $name in
    PATH|HOME|USER|LOGNAME|HOSTNAME|SHELL|TERM|PWD|OLDPWD|SHLVL|_|VIRTUAL_ENV|LD_LIBRARY_PATH|LD_PRELOAD|TMPDIR|DOCKER_HOST) ;;
    *) envs+=(-e "$name") ;;
  esac
done < <(compgen -e)
export DOCKER_HOST=@DOCKER_HOST@
# shellcheck disable=SC2016  # expanded inside the container
exec @DOCKER@ run --rm --init --network host --pid host --ipc host --user "$(id -u):$(id -g)" -w "$PWD" "${mounts[@]}" \
  "${envs[@]}" @IMAGE@ bash -c 'test -f /opt/trainstack/versions.json && echo "in-container: /opt/trainstack/versions.json on $(hostname)" >&2; exec "$@"' bash "$@"
