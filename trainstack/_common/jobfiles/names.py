"""The names inside a job folder, written once: every file and subfolder, the per-rank and per-node log names, the
bash wrapper every Slurm task runs in (``EXIT_RECORD_SH``) and the memory cleanup each node runs
(``FREE_MEMORY_SH``). Torch-free, stdlib only."""

from __future__ import annotations

from .. import envvars as envvars

__all__ = ["Names", "EXIT_RECORD_SH", "FREE_MEMORY_SH", "DRIVER_SILENT_S", "DRIVER_QUIET_S", "ATTEMPT_MARK",
           "OFFERED", "rank_log", "node_log", "rank_stacks", "rank_unit", "RANK_LOG_RE"]

#: What a next-step offer may set in a waiting rank: the step's rendezvous and counters, nothing else.
OFFERED = ("MASTER_ADDR", "MASTER_PORT", envvars.ATTEMPT, envvars.STEP, envvars.NPROCS, envvars.PLANNED_WORLD)
#: A rank log's name, read back: its rank.
RANK_LOG_RE = r"rank-(\d+)\.out$"


def rank_log(rank: int | str) -> str:
    """A rank's own log in the job folder (the task wrapper's copy of its output)."""
    return f"rank-{rank}.out"


def node_log(node: int | str) -> str:
    """A node task's log (torchrun, spawn: one task per node)."""
    return f"node-{node}.out"


def rank_unit(rank: int | str) -> str:
    """A rank's task as its exit record names it (``exits/rank-<r>``)."""
    return f"rank-{rank}"


def rank_stacks(rank: int | str) -> str:
    """A rank's Python stacks in a hang or debug report folder."""
    return f"rank-{rank}.txt"


class Names:
    """The job folder's file and subfolder names (``JobFiles`` and its protocols inherit them)."""

    STARTED = "started"              # one ISO time per run of the program (attempt or job step)
    EXIT_CODE = "exit_code"          # the job's exit status, written when the driver ends
    EXITS = "exits"                  # exits/<unit>: a failing task's end (EXIT_RECORD_SH)
    LOST = "lost"                    # "HOST RANKS" per node that did not answer after its step failed
    PEERS_LOST = "peers-lost"        # peers-lost/rank-<r>: "TIME STEP HOST [waiting]" of a rank that lost a peer
    REJOIN = "rejoin"                # rejoin/step-<n>.json: the driver's next step, for the ranks waiting in place
    STEPS = "steps"                  # steps/<host>-<wrapper pid>: the job step a rank restarted in place is in
    CANCELLED = "cancelled"          # trainstack cancel: the driver never requeues
    STOP = ".stop"                   # the graceful-stop request the trainer polls; .saved / .finished its answers
    NODE_CHECK = "node-check"        # node-check/<host>.json, links.json: one check's figures
    NODE_CHECKS = "node-checks.jsonl"
    MEMORY_FOLDERS = "memory-folders"  # the /dev/shm folders the driver frees on every node at the end
    MEMORY_FREED = "memory-freed"    # a line per rank that freed its own copies (its host): nothing left there
    EVENTS = "events.jsonl"
    VERDICTS = "verdicts.jsonl"
    PROGRESS = "progress"            # the watchdog's furthest step
    RUN_FOLDER = "run-folder"        # the Trainer's run folder (trainstack fetch --what run)
    LEDGER = "ledger"                # ledger/<n>.json: the watchdog's per-step goodput
    SCRIPT = "job.sbatch"            # a copy of the batch script
    METADATA = "metadata.json"       # trainstack submit's record (0600)
    CODE = "code"                    # the code snapshot
    DRIVER = "driver"                # trainstack submit's copy of the torch-free driver for the batch host
    ALIVE = "driver.alive"           # the driver's heartbeat (its mtime), for status and the sentinel
    DRIVER_END = "driver.ended"      # written when the driver ends: the sentinel stands down
    DRIVER_HOST = "driver.host"      # where the allocation's driver runs now ("host pid"): a replaced one stops
    SENTINEL_HOST = "sentinel.host"  # where the driver's one sentinel runs now: any other stands down
    PLAN = "plan.json"               # the job's plan (0600): what a driver taking over on another node runs


#: Every Slurm task of a job step runs ``bash -c EXIT_RECORD_SH trainstack-task KIND PROGRAM...``: a copy of its
#: output in the job folder (KIND rank: rank-<r>.out; node: node-<n>.out; none: the program writes its own), the
#: program's exit status as the task's whatever happens to the copy, signals sent to the step reaching the program
#: while the wrapper and tee outlive them, and a failing task's end recorded in exits/<unit> (time status unit host)
#: -- so the driver reports the first failure, not the kills that followed it. A rank restarted in place belongs to a
#: later job step than its task: it says which in steps/<host>-<wrapper pid> (``note_step``); a step that starts
#: only some ranks names each task's rank in TRAINSTACK_TASK_RANKS. A warm standby (KIND standby) is no rank until
#: the driver orders it to be one: it names that rank in steps/<host>-<wrapper pid>.rank, and a standby that never
#: became a rank records nothing.
EXIT_RECORD_SH = r'''trap : USR1 USR2 TERM INT HUP
case "$1" in
  rank) r=$SLURM_PROCID
    if [[ -n "${TRAINSTACK_TASK_RANKS:-}" ]]; then IFS=, read -ra rs <<< "${TRAINSTACK_TASK_RANKS#*/}"; r=${rs[$r]}; fi
    unit="rank-$r"; export TRAINSTACK_RANK_LOG="$TRAINSTACK_JOB_DIR/$unit.out" ;;
  node) unit="node-$SLURM_NODEID"; export TRAINSTACK_NODE_LOG="$TRAINSTACK_JOB_DIR/$unit.out" ;;
  standby) unit="" ;;
  *) unit="node-$SLURM_NODEID" ;;
esac
log="${TRAINSTACK_RANK_LOG:-${TRAINSTACK_NODE_LOG:-}}"
shift
if [[ -n "$log" ]]; then
  "$@" 2>&1 | (trap "" USR1 USR2 TERM INT HUP; umask 022; exec tee -a "$log")
  rc=${PIPESTATUS[0]}
else
  "$@"
  rc=$?
fi
if [[ "$rc" -ne 0 ]]; then
  (umask 022; d="$TRAINSTACK_JOB_DIR/exits"; mkdir -p "$d" 2>/dev/null; [[ -d "$d" && ! -L "$d" && -O "$d" ]] || exit
   f="$TRAINSTACK_JOB_DIR/steps/$(hostname)-$$"; step=${TRAINSTACK_STEP:-0}
   if [[ -f "$f" && ! -L "$f" && -O "$f" ]]; then step=$(head -c 20 "$f" 2>/dev/null); fi
   if [[ -z "$unit" ]]; then [[ -f "$f.rank" && ! -L "$f.rank" && -O "$f.rank" ]] || exit
     r=$(head -c 20 "$f.rank" 2>/dev/null); r=${r//[^0-9]/}; [[ -n "$r" ]] || exit; unit="rank-$r"; fi
   t=$(mktemp "$d/.$unit.XXXXXX" 2>/dev/null) || exit
   echo "$(date +%s.%N) $rc $unit ${SLURMD_NODENAME:-$(hostname)} ${step//[^0-9]/}" > "$t" && mv -fT "$t" "$d/$unit")
fi
exit "$rc"'''

#: Frees one job's memory checkpoints on a node (``bash -c FREE_MEMORY_SH _ JOB ROOT...``): the folders
#: ``<root>/job-<JOB>-*`` of this user's memory root (``$TRAINSTACK_MEMORY_DIR`` or /dev/shm, then
#: ``trainstack-<uid>``) and of each ROOT the job recorded -- each a real folder of this user's named
#: ``trainstack-<uid>``, nothing else, and never through a link (``JobFiles.memory_roots`` checks the ROOTs first).
FREE_MEMORY_SH = ('job="$1"; shift; me="trainstack-$(id -u)"; '
                  'for root in "${TRAINSTACK_MEMORY_DIR:-/dev/shm}/$me" "$@"; do '
                  '[[ "${root##*/}" == "$me" && -d "$root" && ! -L "$root" && -O "$root" ]] || continue; '
                  'for d in "$root"/job-"$job"-*; do [[ -d "$d" && ! -L "$d" && -O "$d" ]] && rm -rf -- "$d"; done; '
                  'done; true')

#: The driver's heartbeat (``driver.alive``'s mtime) is touched every ``DRIVER_BEAT_S``. After ``DRIVER_SUSPECT_S``
#: without a new beat the sentinel asks Slurm whether the batch host answers (a trivial step there): one that does
#: not is lost, and the sentinel takes the driver's place at once. A driver silent for ``DRIVER_SILENT_S`` on a host
#: that still answers counts as gone too (hung). ``status`` and ``why`` say "no driver" from ``DRIVER_QUIET_S`` on.
DRIVER_BEAT_S = 1.0
DRIVER_SUSPECT_S = 3.0
DRIVER_SILENT_S = 30.0
DRIVER_QUIET_S = 15.0

#: The line written into every rank and node log when an attempt (or a job step of it) starts: a verdict reads only
#: what follows the last one.
ATTEMPT_MARK = "=== trainstack: attempt "
