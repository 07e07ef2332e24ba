#!/usr/bin/env bash
# Start/stop a Slurm cluster on this host: one slurmctld and `slurmd -N node1|node2|node3`. Partition debug (the
# default) is node1-2 with fake GPUs; node3 has none: partition cpuonly is node3 alone (a CPU-only cluster), partition
# spares is node1-3 (a spare node for in-allocation recovery).
# Facts and settings: ../shared/docs/hpc.md (e). Needs root and Debian's slurm-wlm + munge.
# Usage: scripts/slurm-local.sh up|down|status|env
# A second, independent cluster beside it (another ClusterName, state folder, ports and node names; the same munge):
#   TRAINSTACK_SLURM_CLUSTER=beta scripts/slurm-local.sh up   -> /tmp/trainstack-slurm-beta, nodes beta1-beta2
set -euo pipefail

CLUSTER="${TRAINSTACK_SLURM_CLUSTER:-trainstack}"
if [[ $CLUSTER == trainstack ]]; then
  DEFAULT_DIR=/tmp/trainstack-slurm; N=node; CTLD=26817; SLURMD=26818; NODE_PORT=27001; FULL=1
else
  [[ $CLUSTER =~ ^[a-z][a-z0-9]{0,9}$ ]] || { echo "slurm-local: TRAINSTACK_SLURM_CLUSTER=$CLUSTER: lower-case letters and digits, at most 10" >&2; exit 1; }
  # ports from the name, away from the first cluster's
  off=$(( ($(printf '%s' "$CLUSTER" | cksum | cut -d' ' -f1) % 40 + 1) * 20 ))
  DEFAULT_DIR=/tmp/trainstack-slurm-$CLUSTER; N=$CLUSTER; CTLD=$((26817 + off)); SLURMD=$((26818 + off))
  NODE_PORT=$((27001 + off)); FULL=0
fi
STATE_DIR="${TRAINSTACK_SLURM_DIR:-$DEFAULT_DIR}"
CONF="$STATE_DIR/slurm.conf"
CPUS="${TRAINSTACK_SLURM_CPUS:-$(nproc)}"
# Each fake node advertises all host cores: 2 nodes x 2 tasks need 2 CPUs per node.
[[ "$CPUS" -lt 2 ]] && CPUS=2

die() { echo "slurm-local: $*" >&2; exit 1; }

write_conf() {
  mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool" "$STATE_DIR/log"
  cat > "$CONF" <<CONF
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD
SlurmdPort=$SLURMD
AuthType=auth/munge
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=10
# a node whose slurmd stops answering is DOWN (its jobs NODE_FAIL) within ~30 s, not Slurm's default 300 s:
# tests/slurm/test_verdicts.py kills one slurmd to make a node failure
SlurmdTimeout=30
# ended jobs leave slurmctld quickly, as on a busy cluster: trainstack status must fall back to the job folder
MinJobAge=10
GresTypes=gpu
NodeName=${N}[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$NODE_PORT-$((NODE_PORT + 1))] CPUs=$CPUS RealMemory=4000 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=${N}[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  if [[ $FULL == 1 ]]; then cat >> "$CONF" <<CONF
NodeName=node3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=27003 CPUs=$CPUS RealMemory=4000 State=UNKNOWN
PartitionName=cpuonly Nodes=node3 MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=spares Nodes=node[1-3] MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  fi
  # Fake GPUs: Slurm fills CUDA_VISIBLE_DEVICES/SLURM_GPUS_ON_NODE as on a real GPU node.
  cat > "$STATE_DIR/gres.conf" <<CONF
AutoDetect=off
NodeName=${N}[1-2] Name=gpu File=/dev/tty[1-2]
CONF
}

ensure_hosts() {
  # MASTER_ADDR=node1 must resolve on every "node".
  grep -qE '^127\.0\.0\.1[[:space:]].*\bnode3\b' /etc/hosts || echo "127.0.0.1 node1 node2 node3" >> /etc/hosts
  if [[ $FULL == 0 ]]; then
    grep -qE "^127\.0\.0\.1[[:space:]].*\b${N}2\b" /etc/hosts || echo "127.0.0.1 ${N}1 ${N}2" >> /etc/hosts
  fi
}

start_munge() {
  pgrep -x munged >/dev/null && return 0
  [[ -f /etc/munge/munge.key ]] || { command -v mungekey >/dev/null && mungekey --create; }
  mkdir -p /run/munge; chown munge:munge /run/munge 2>/dev/null || true
  if id munge >/dev/null 2>&1; then
    su -s /bin/sh munge -c "munged --force" || munged --force
  else
    munged --force
  fi
}

wait_idle() {
  for _ in $(seq 1 60); do
    if [[ "$(sinfo -h -o %t 2>/dev/null | sort -u | tr '\n' ' ')" == "idle " ]]; then return 0; fi
    sleep 0.5
  done
  sinfo >&2 || true
  die "nodes did not become idle; see $STATE_DIR/log/"
}

up() {
  command -v slurmctld >/dev/null || die "slurmctld not found. Install: apt-get install -y slurm-wlm munge"
  [[ "$(id -u)" == 0 ]] || die "must run as root (slurmd needs it)"
  export SLURM_CONF="$CONF"
  if [[ -f "$CONF" ]] && scontrol ping >/dev/null 2>&1 && sinfo -h -o %t | grep -q idle; then
    echo "slurm-local: already up (SLURM_CONF=$CONF)"; return 0
  fi
  write_conf
  ensure_hosts
  start_munge
  slurmctld -f "$CONF"
  slurmd -f "$CONF" -N "${N}1"
  slurmd -f "$CONF" -N "${N}2"
  if [[ $FULL == 1 ]]; then slurmd -f "$CONF" -N node3; fi
  wait_idle
  echo "slurm-local: up. Use: export SLURM_CONF=$CONF"
}

down() {
  export SLURM_CONF="$CONF"
  if [[ -f "$CONF" ]]; then scancel --quiet --user=root 2>/dev/null || true; fi
  for pidf in "$STATE_DIR"/slurmd-*.pid "$STATE_DIR"/slurmctld.pid; do
    if [[ -f "$pidf" ]]; then kill "$(cat "$pidf")" 2>/dev/null || true; fi
  done
  sleep 1
  pkill -f "slurmd -f $CONF" 2>/dev/null || true
  pkill -f "slurmctld -f $CONF" 2>/dev/null || true
  echo "slurm-local: down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) export SLURM_CONF="$CONF"; sinfo; squeue ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) die "usage: $0 up|down|status|env" ;;
esac
