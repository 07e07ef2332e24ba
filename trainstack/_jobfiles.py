"""The job folder's contents, owned here: every file name inside ``<log dir>/<name>-<job id>/`` and the one way to
read or write each. The allocation driver, the verdicts, ``status``, the attempt reports, the goodput ledger, the
watchdog, the graceful stop and the memory checkpoints all go through ``JobFiles``; no other module spells a name.
``JobPaths`` (``_slurm/jobfolder.py``) owns where the folder is, this module what is in it. Torch-free leaf.

The one writer that is not Python is ``EXIT_RECORD_SH``: the bash wrapper every Slurm task runs in, which records a
failing task's end (when, status, task, host) in ``exits/`` for the driver to read.

Everything here is read back as untrusted data (``_files.read_back``): a record must belong to the folder's owner
(this user, for the driver and the ranks, who act on it) and be writable by nobody else, or it is passed over with
a line that names it; every file and subfolder is written so that nobody else can write it, whatever the umask, and
never through a link someone planted.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _envvars as envvars
from ._files import (
    SMALL,
    UnreadableFile,
    UntrustedFileError,
    atomic_write,
    open_append,
    own_folder,
    pass_over,
    read_back,
    read_back_text,
    read_jsonl,
)

__all__ = ["JobFiles", "Exit", "Offer", "EXIT_RECORD_SH", "FREE_MEMORY_SH", "DRIVER_SILENT_S", "DRIVER_QUIET_S",
           "OFFERED", "UntrustedFileError"]

#: What a next-step offer may set in a waiting rank: the step's rendezvous and counters, nothing else.
OFFERED = ("MASTER_ADDR", "MASTER_PORT", envvars.ATTEMPT, envvars.STEP, envvars.NPROCS, envvars.PLANNED_WORLD)
_HOST = re.compile(r"^[A-Za-z0-9_.:-]{1,253}$")
_MAX_RANKS = 1 << 20


@dataclass(frozen=True)
class Offer:
    """The driver's next job step for the ranks waiting in place (``rejoin/step-<n>.json``), checked: ``env`` holds
    only ``OFFERED`` names with values of their type."""

    step: int
    env: dict[str, str] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    per_node: int = 1

    @property
    def where(self) -> str:
        return f"{self.env.get('MASTER_ADDR', '?')}:{self.env.get('MASTER_PORT', '?')}"

    @classmethod
    def parse(cls, data: object, named_step: int) -> Offer:
        """The offer in ``data`` (decoded JSON of the file named for step ``named_step``), or ValueError naming what
        is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"is not a JSON object but {type(data).__name__}")
        step, ranks, per_node, env = data.get("step"), data.get("ranks"), data.get("per_node"), data.get("env")
        if type(step) is not int or step != named_step:
            raise ValueError(f"names step {step!r}, not the step {named_step} of its name")
        if not isinstance(ranks, list) or not ranks or len(ranks) > _MAX_RANKS or \
                any(type(r) is not int or not 0 <= r < _MAX_RANKS for r in ranks):
            raise ValueError(f"'ranks' must be a list of ranks (non-negative integers), not {str(ranks)[:80]!r}")
        if type(per_node) is not int or not 1 <= per_node <= 4096:
            raise ValueError(f"'per_node' must be an integer from 1 to 4096, not {per_node!r}")
        if not isinstance(env, dict):
            raise ValueError(f"'env' must be an object, not {type(env).__name__}")
        extra = sorted(str(k) for k in env if k not in OFFERED)
        if extra:
            raise ValueError(f"'env' sets {', '.join(extra)[:200]}, which an offer never sets (only "
                             f"{', '.join(OFFERED)})")
        for key, value in env.items():
            if not isinstance(value, str) or not value or "\0" in value or len(value) > 255:
                raise ValueError(f"'env' {key} must be a short string, not {str(value)[:80]!r}")
            if key == "MASTER_ADDR" and not _HOST.match(value):
                raise ValueError(f"'env' MASTER_ADDR {value[:80]!r} is not a host name")
            if key != "MASTER_ADDR" and not (value.isdigit() and len(value) < 10):
                raise ValueError(f"'env' {key} must be a number, not {value[:80]!r}")
        if not 0 < int(env.get("MASTER_PORT", "1")) < 65536:
            raise ValueError(f"'env' MASTER_PORT {env['MASTER_PORT']} is not a port")
        if env.get(envvars.STEP, str(step)) != str(step):
            raise ValueError(f"'env' {envvars.STEP} {env[envvars.STEP]} is not its step {step}")
        return cls(step, dict(env), tuple(ranks), per_node)


@dataclass(frozen=True)
class Exit:
    """A task that ended with an error status, as its wrapper recorded it (``exits/<unit>``)."""

    time: float
    code: int
    unit: str  # rank-<r> (one task per rank: srun) or node-<n> (one task per node: torchrun, spawn, custom)
    host: str
    step: int | None = None  # the job step (TRAINSTACK_STEP) it belonged to; None in a record without one

    @property
    def rank(self) -> int | None:
        return int(self.unit[5:]) if self.unit.startswith("rank-") and self.unit[5:].isdigit() else None

    @property
    def where(self) -> str:
        return f"rank {self.rank} ({self.host})" if self.rank is not None else f"the task on {self.host}"


#: Every Slurm task of a job step runs ``bash -c EXIT_RECORD_SH trainstack-task KIND PROGRAM...``: a copy of its
#: output in the job folder (KIND rank: rank-<r>.out; node: node-<n>.out; none: the program writes its own), the
#: program's exit status as the task's whatever happens to the copy, signals sent to the step reaching the program
#: while the wrapper and tee outlive them, and a failing task's end recorded in exits/<unit> (time status unit host)
#: -- so the driver reports the first failure, not the kills that followed it. A rank restarted in place belongs to a
#: later job step than its task: it says which in steps/<host>-<wrapper pid> (``note_step``); a step that starts
#: only some ranks names each task's rank in TRAINSTACK_TASK_RANKS.
EXIT_RECORD_SH = r'''trap : USR1 USR2 TERM INT HUP
case "$1" in
  rank) r=$SLURM_PROCID
    if [[ -n "${TRAINSTACK_TASK_RANKS:-}" ]]; then IFS=, read -ra rs <<< "${TRAINSTACK_TASK_RANKS#*/}"; r=${rs[$r]}; fi
    unit="rank-$r"; export TRAINSTACK_RANK_LOG="$TRAINSTACK_JOB_DIR/$unit.out" ;;
  node) unit="node-$SLURM_NODEID"; export TRAINSTACK_NODE_LOG="$TRAINSTACK_JOB_DIR/$unit.out" ;;
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

#: Seconds without the driver's heartbeat (touched every 5 s) after which it counts as gone: its batch host lost
#: (the sentinel requeues the job then). ``status`` and ``why`` say so from ``DRIVER_QUIET_S`` on (three missed beats),
#: so the user reads it before the requeue, not only after.
DRIVER_SILENT_S = 30.0
DRIVER_QUIET_S = 15.0

#: The line written into every rank and node log when an attempt (or a job step of it) starts: a verdict reads only
#: what follows the last one.
ATTEMPT_MARK = "=== trainstack: attempt "


@dataclass(frozen=True)
class JobFiles:
    """One job folder (an array task's own folder) and everything in it, by name. ``owner``: the uid its records
    must belong to (None: the folder's own owner -- ``status`` of a teammate's job; the driver and the ranks, who
    act on what they read, trust only their own user's)."""

    folder: Path
    owner: int | None = None

    # the names, each written once
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

    @classmethod
    def current(cls) -> JobFiles | None:
        """The folder of the job this process runs in (``TRAINSTACK_JOB_DIR``), or None outside a job."""
        folder = os.environ.get(envvars.JOB_DIR)
        return cls(Path(folder), os.getuid()) if folder else None

    @classmethod
    def mine(cls, folder: Path) -> JobFiles:
        """A job folder this process acts on (the driver, the sentinel, the ranks): only this user's records count."""
        return cls(Path(folder), os.getuid())

    def path(self, name: str) -> Path:
        return self.folder / name

    @property
    def uid(self) -> int:
        """Whose records count here."""
        if self.owner is not None:
            return self.owner
        try:
            return self.folder.lstat().st_uid
        except OSError:
            return os.getuid()

    def make_own(self) -> None:
        """The job folder as this user's: created (never writable by group or others, whatever the umask) or, if
        there, checked to be this user's and made unwritable by others; someone else's raises
        ``UntrustedFileError``."""
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        own_folder(self.folder)

    def _read(self, path: Path, limit: int = SMALL) -> str:
        return read_back_text(path, limit, self.uid)

    def _json(self, path: Path) -> Any:
        try:
            return json.loads(self._read(path) or "null")
        except ValueError:
            pass_over(UnreadableFile(path, "is not JSON"))
            return None

    def _present(self, path: Path) -> bool:
        """``path`` is there as a file of the folder's owner (a flag someone else planted is not)."""
        try:
            st = path.lstat()
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == self.uid and not st.st_mode & 0o022

    def _mtime(self, path: Path) -> float | None:
        return path.lstat().st_mtime if self._present(path) else None

    def _sub(self, name: str) -> Path:
        """A subfolder records are written into: this user's only (``own_folder``)."""
        return own_folder(self.path(name))

    def _files_in(self, name: str, pattern: str) -> list[Path]:
        """The files matching ``pattern`` in subfolder ``name`` when that folder is the owner's (else none)."""
        folder = self.path(name)
        try:
            st = folder.lstat()
        except OSError:
            return []
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != self.uid or st.st_mode & 0o022:
            pass_over(UnreadableFile(folder, "is not a folder of the job's owner that only they can write"))
            return []
        return sorted(folder.glob(pattern))

    # ------------------------------------------------------------------ runs and the job's end
    def submitted_code(self) -> dict[str, Any]:
        """The submission's git record (``commit``, ``dirty``) from trainstack submit's metadata ({} without one)."""
        found = self.metadata().get("git")
        return dict(found) if isinstance(found, dict) else {}

    def metadata(self) -> dict[str, Any]:
        """trainstack submit's record of this job ({} without one, or an unreadable one)."""
        found = self._json(self.path(self.METADATA))
        return found if isinstance(found, dict) else {}

    def mark_started(self) -> None:
        with open_append(self.path(self.STARTED)) as fh:
            fh.write(datetime.datetime.now().astimezone().isoformat(timespec="seconds") + "\n")

    def starts(self) -> list[str]:
        return [line.strip() for line in self._read(self.path(self.STARTED)).splitlines() if line.strip()]

    def runs_before(self) -> int:
        """How many times this job ran its program before the current run (requeues and retries alike)."""
        return max(0, len(self.starts()) - 1)

    def attempt_start(self) -> float:
        """When the current run started (the last line of ``started``), 0 when unknown."""
        lines = self.starts()
        try:
            return datetime.datetime.fromisoformat(lines[-1]).timestamp() if lines else 0.0
        except ValueError:
            return 0.0

    def has_started(self) -> bool:
        return self._present(self.path(self.STARTED))

    def write_exit_code(self, status: int) -> None:
        try:
            atomic_write(self.path(self.EXIT_CODE), f"{status}\n")
        except OSError:  # a folder deleted meanwhile must not turn success into failure
            pass

    def clear_exit_code(self) -> None:
        self.path(self.EXIT_CODE).unlink(missing_ok=True)

    def exit_code(self) -> str | None:
        """The recorded exit status (its last line), or None when the job never wrote one."""
        lines = self._read(self.path(self.EXIT_CODE)).strip().splitlines()
        return lines[-1].strip() if lines else None

    def exit_code_time(self) -> float | None:
        return self._mtime(self.path(self.EXIT_CODE))

    def started_time(self) -> float | None:
        return self._mtime(self.path(self.STARTED))

    def seal_logs(self) -> None:
        """The logs a job step's programs wrote here with the user's umask (NCCL's ``nccl.*.log``, its flight
        recorder's dumps) made unwritable by others: ``why`` reads them as this user's."""
        for path in [*self.folder.glob("nccl.*.log"), *self.folder.glob("nccl-trace-rank-*")]:
            try:
                st = path.lstat()
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o022:
                    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022, follow_symlinks=False)
            except (OSError, NotImplementedError):
                continue

    def mark_attempt_in_logs(self, label: str) -> None:
        """``=== trainstack: attempt LABEL starts at ...`` in every rank and node log already there."""
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        for log in [*self.folder.glob("rank-*.out"), *self.folder.glob("node-*.out")]:
            try:
                with open_append(log) as fh:
                    fh.write(f"{ATTEMPT_MARK}{label} starts at {stamp}\n")
            except OSError:
                pass

    # ------------------------------------------------------------------ one job step's failures
    def clear_step(self) -> None:
        """Before a job step: no exit record, lost node or next-step offer of the one before (this step's offer is
        written after)."""
        import shutil

        for name in (self.EXITS, self.PEERS_LOST, self.REJOIN):  # a requeued job counts its steps from 0 again
            if self.path(name).is_symlink():
                self.path(name).unlink()
            shutil.rmtree(self.path(name), ignore_errors=True)
        self.path(self.LOST).unlink(missing_ok=True)

    def exits(self, step: int | None = None) -> list[Exit]:
        """The failing tasks of job step ``step`` (None: of the newest step any record names), first first. A task
        of the step before that dies after the next one started (its remains are killed, not waited for) records
        its step, so it never reads as the new step's failure."""
        found = []
        for path in self._files_in(self.EXITS, "[!.]*"):
            parts = self._read(path).split()
            try:
                found.append(Exit(float(parts[0]), int(parts[1]), parts[2], parts[3],
                                  int(parts[4]) if len(parts) > 4 else None))
            except (IndexError, ValueError, OverflowError):
                continue
        if step is None:
            step = max((x.step for x in found if x.step is not None), default=None)
        return sorted((x for x in found if x.step is None or step is None or x.step == step), key=lambda x: x.time)

    def has_exits(self, step: int | None = None) -> bool:
        return bool(self.exits(step))

    def peer_lost(self, rank: int, host: str, step: int, waiting: bool = False) -> None:
        """This rank's collective failed because a peer is gone (it waits, asleep, before it leaves; ``waiting``: it
        waits in place for the next step, ``rejoin_offer``): the driver's detection of the failure without waiting
        for an exit (``fastexit``). One write; never raises."""
        try:
            mark = " waiting" if waiting else ""
            atomic_write(self._sub(self.PEERS_LOST) / f"rank-{rank}", f"{time.time():.3f} {step} {host}{mark}\n")
        except OSError:
            pass

    def waiting(self, step: int) -> dict[int, str]:
        """The ranks of job step ``step`` waiting in place for the next step, each with its host."""
        found = {}
        for path in self._files_in(self.PEERS_LOST, "rank-*"):
            parts = self._read(path).split()
            if len(parts) > 3 and parts[3] == "waiting" and parts[1] == str(step) and path.name[5:].isdigit():
                found[int(path.name[5:])] = parts[2]
        return found

    def offer_rejoin(self, step: int, env: dict[str, str], ranks: list[int], per_node: int) -> None:
        """The next job step ``step``, for the ``ranks`` waiting in place (each keeps its rank; ``per_node`` ranks
        per node): the environment they take (rendezvous, counters, sizes) before they join its process group;
        written whole (a reader never sees half of it)."""
        offered = {k: str(v) for k, v in env.items() if k in OFFERED}
        Offer.parse({"step": step, "env": offered, "ranks": ranks, "per_node": per_node}, step)  # as it is read
        atomic_write(self._sub(self.REJOIN) / f"step-{step}.json",
                     json.dumps({"step": step, "env": offered, "ranks": ranks, "per_node": per_node}))

    def rejoin_offer(self, after: int) -> Offer | None:
        """The newest next-step offer for a step after ``after``, or None (yet): only the owner's, checked
        (``Offer.parse``); one that is not is passed over with a line naming it."""
        steps = {int(p.name[5:-5]): p for p in self._files_in(self.REJOIN, "step-*.json")
                 if p.name[5:-5].isdigit() and len(p.name) < 20}
        for n in sorted((n for n in steps if n > after), reverse=True):
            try:
                return Offer.parse(json.loads(read_back(steps[n], SMALL, self.uid)), n)
            except FileNotFoundError:
                continue
            except UnreadableFile as exc:
                pass_over(exc, "an offer")
            except json.JSONDecodeError:
                pass_over(UnreadableFile(steps[n], "is not JSON: not an offer of the driver's"), "an offer")
            except ValueError as exc:
                pass_over(UnreadableFile(steps[n], f"is not an offer of the driver's: {exc}"), "an offer")
        return None

    def joined(self, rank: int, step: int) -> None:
        """A rank that waited in place joined job step ``step``'s process group (the driver counts the step as
        started with it only then). Never raises."""
        try:
            atomic_write(self._sub(self.REJOIN) / f"joined-{step}-rank-{rank}", f"{time.time():.3f}\n")
        except OSError:
            pass

    def joined_ranks(self, step: int) -> set[int]:
        """The waiting ranks that joined job step ``step``."""
        prefix = f"joined-{step}-rank-"
        return {int(p.name[len(prefix):]) for p in self._files_in(self.REJOIN, f"{prefix}*")
                if p.name[len(prefix):].isdigit() and self._present(p)}

    def note_step(self, host: str, wrapper_pid: int, step: int) -> None:
        """A rank restarted in place is now in job step ``step``: its task's wrapper records a failure under it."""
        atomic_write(self._sub(self.STEPS) / f"{host}-{wrapper_pid}", str(step))

    def peers_lost(self, step: int | None = None) -> list[float]:
        """When the ranks of job step ``step`` (None: any) that lost a peer said so, first first."""
        return sorted(when for when, _, _ in self._peer_signs(step))

    def peer_hosts(self, step: int | None = None) -> dict[str, float]:
        """The hosts with a rank of job step ``step`` that lost a peer, each with its first such rank's time."""
        hosts: dict[str, float] = {}
        for when, host, _ in self._peer_signs(step):
            hosts[host] = min(when, hosts.get(host, when))
        return hosts

    def accounted(self, step: int) -> set[int]:
        """The ranks of job step ``step`` known to be out of training: an exit recorded (one task per rank) or a
        peer lost."""
        return {x.rank for x in self.exits(step) if x.rank is not None} | {r for _, _, r in self._peer_signs(step)}

    def hosts_out(self, step: int, ranks_per_host: int) -> set[str]:
        """The hosts of job step ``step`` (one task per node: torchrun, spawn) known to be out of training: their task
        recorded its exit, or ``ranks_per_host`` of their ranks said they lost a peer."""
        lost: dict[str, set[int]] = {}
        for _, host, rank in self._peer_signs(step):
            lost.setdefault(host, set()).add(rank)
        return {x.host for x in self.exits(step)} | {h for h, ranks in lost.items() if len(ranks) >= ranks_per_host}

    def _peer_signs(self, step: int | None) -> list[tuple[float, str, int]]:
        found = []
        for path in self._files_in(self.PEERS_LOST, "rank-*"):
            parts = self._read(path).split()
            try:
                if step is None or int(parts[1]) == step:
                    found.append((float(parts[0]), parts[2] if len(parts) > 2 else "", int(path.name[5:])))
            except (IndexError, ValueError, OverflowError):
                continue
        return found

    def first_sign(self, step: int | None = None) -> float | None:
        """When the step's failure first showed: a failing task's exit, or a rank that lost its peer if that was
        earlier (a node lost whole leaves no exit; a torchrun agent records its killed worker ~1 s late)."""
        exits = self.exits(step)
        if step is None and exits:
            step = exits[0].step
        times = [x.time for x in exits[:1]] + self.peers_lost(step)[:1]
        return min(times) if times else None

    def write_lost(self, hosts: dict[str, list[int]]) -> None:
        """The hosts that did not answer after the step failed, with the ranks each ran."""
        text = "".join(f"{host} {','.join(map(str, ranks))}\n" for host, ranks in hosts.items())
        atomic_write(self.path(self.LOST), text)

    def lost(self) -> list[tuple[str, list[str]]]:
        rows = [line.split() for line in self._read(self.path(self.LOST)).splitlines() if line.strip()]
        return [(row[0], row[1].split(",") if len(row) > 1 else []) for row in rows]

    # ------------------------------------------------------------------ the user's cancel
    def cancel(self) -> None:
        atomic_write(self.path(self.CANCELLED), "")

    def cancelled(self) -> bool:
        """``trainstack cancel`` marked this folder (or, for an array task, the whole array's)."""
        return self._present(self.path(self.CANCELLED)) or \
            (self.folder.name.startswith("task-") and self._present(self.folder.parent / self.CANCELLED))

    # ------------------------------------------------------------------ the graceful stop
    @property
    def stop_file(self) -> Path:
        return self.path(self.STOP)

    def request_stop(self) -> None:
        try:
            atomic_write(self.stop_file, "")
        except OSError:
            pass

    def stop_answers(self) -> tuple[bool, bool]:
        """(saved, finished): the trainer checkpointed for a stop; the run had ended before a stop came."""
        return self._present(Path(f"{self.stop_file}.saved")), self._present(Path(f"{self.stop_file}.finished"))

    @staticmethod
    def stop_requested(stop_file: str | os.PathLike) -> bool:
        """The trainer's poll: the driver asked for a graceful stop (a stop file of this user's only)."""
        return JobFiles.mine(Path(stop_file).parent)._present(Path(stop_file))

    def clear_stop(self) -> None:
        for suffix in ("", ".saved", ".finished"):
            Path(f"{self.stop_file}{suffix}").unlink(missing_ok=True)

    @staticmethod
    def confirm_saved(stop_file: str, checkpoint: Path | None) -> None:
        """The trainer's answer to a stop request: its checkpoint is complete."""
        atomic_write(stop_file + ".saved", str(checkpoint or ""))

    @staticmethod
    def confirm_finished(stop_file: str, step: int) -> None:
        """The trainer's note that its run finished with its final checkpoint."""
        try:
            atomic_write(stop_file + ".finished", f"{step}\n")
        except OSError:
            pass

    # ------------------------------------------------------------------ node checks
    @property
    def node_check_dir(self) -> Path:
        return self.path(self.NODE_CHECK)

    def node_check_figures(self, host: str) -> Any:
        return self._json(self.node_check_dir / f"{host}.json")

    def node_check_links(self) -> Any:
        return self._json(self.node_check_dir / "links.json")

    def node_checks(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path(self.NODE_CHECKS), self.uid)

    def append_node_check(self, record: dict[str, Any]) -> None:
        self._append(self.NODE_CHECKS, record)

    # ------------------------------------------------------------------ verdicts and events
    def verdicts(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path(self.VERDICTS), self.uid)

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_file, self.uid)

    def append_verdict(self, record: dict[str, Any]) -> None:
        self._append(self.VERDICTS, record)

    @property
    def events_file(self) -> Path:
        return self.path(self.EVENTS)

    def record_event(self, kind: str, /, **fields: Any) -> None:
        """Append ``{"kind": kind, "time": now, **fields}`` to the job's timeline (one write, never through a
        planted link; never raises: a read-only or deleted job folder must not stop the run)."""
        line = json.dumps({"kind": kind, "time": time.time(), **fields}, default=str) + "\n"
        try:
            fd = os.open(self.events_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError:
            pass

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open_append(self.path(name)) as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    # ------------------------------------------------------------------ what the training side leaves
    def write_progress(self, step: int) -> None:
        atomic_write(self.path(self.PROGRESS), json.dumps({"step": step, "time": time.time()}))

    def progress_step(self) -> int | None:
        found = self._json(self.path(self.PROGRESS))
        return int(found["step"]) if isinstance(found, dict) and type(found.get("step")) is int else None

    def write_run_folder(self, folder: Path) -> None:
        atomic_write(self.path(self.RUN_FOLDER), f"{folder.resolve()}\n")

    def run_folder(self) -> str:
        return self._read(self.path(self.RUN_FOLDER)).strip()

    @property
    def ledger_dir(self) -> Path:
        return self.path(self.LEDGER)

    def own_ledger_dir(self) -> Path:
        """The ledger folder, to write into (this user's only)."""
        return self._sub(self.LEDGER)

    def ledger_files(self) -> list[Path]:
        return self._files_in(self.LEDGER, "*.json")

    def ledger(self, path: Path) -> Any:
        return self._json(path)

    def record_memory_folder(self, folder: Path) -> None:
        """A /dev/shm folder of memory checkpoints the driver frees on every node at the job's end (only its root
        is ever used: ``memory_roots``)."""
        known = self.memory_folders()
        if str(folder) not in known:
            with open_append(self.path(self.MEMORY_FOLDERS)) as fh:
                fh.write(f"{folder}\n")

    def memory_folders(self) -> list[str]:
        return [line for line in self._read(self.path(self.MEMORY_FOLDERS)).splitlines() if line.strip()]

    def memory_roots(self) -> list[str]:
        """The memory roots (``<dir>/trainstack-<uid>``) the job's listing names, each checked: an absolute, normal
        path (no ``..``, no trailing ``/``) ending in this user's ``trainstack-<uid>``, above a ``job-*`` entry.
        ``FREE_MEMORY_SH`` removes only that job's folders directly inside them."""
        roots: list[str] = []
        for line in self.memory_folders():
            root, name = os.path.split(line)
            if not (line.startswith("/") and os.path.normpath(line) == line and name.startswith("job-")
                    and os.path.basename(root) == f"trainstack-{os.getuid()}" and "\n" not in line):
                pass_over(UnreadableFile(self.path(self.MEMORY_FOLDERS), f"names {line[:200]!r}, not a memory "
                                                                         f"checkpoint folder of this user's"))
                continue
            if root not in roots:
                roots.append(root)
        return roots

    def forget_memory_folders(self) -> None:
        self.path(self.MEMORY_FOLDERS).unlink(missing_ok=True)

    # ------------------------------------------------------------------ the driver
    def beat(self) -> None:
        """The driver is alive (the heartbeat's mtime)."""
        try:
            if self._present(self.path(self.ALIVE)):
                os.utime(self.path(self.ALIVE), follow_symlinks=False)
            else:
                atomic_write(self.path(self.ALIVE), "")
        except OSError:
            pass

    def driver_silent_for(self, now: float | None = None) -> float | None:
        """Seconds since the driver's last heartbeat (None: it never beat, or it ended)."""
        if self._present(self.path(self.DRIVER_END)):
            return None
        beat = self._mtime(self.path(self.ALIVE))
        return None if beat is None else (now or time.time()) - beat

    def driver_ended(self, why: str) -> None:
        try:
            atomic_write(self.path(self.DRIVER_END), why + "\n")
        except OSError:
            pass

    def driver_started(self) -> None:
        self.path(self.DRIVER_END).unlink(missing_ok=True)
        self.beat()

    def has_script(self) -> bool:
        return self._present(self.path(self.SCRIPT))

    def report(self, restart: int, step_index: int, suffix: str) -> Path:
        """The attempt report of job step ``restart.step_index`` (``.txt`` or ``.json``)."""
        return self.path(f"attempt-{restart}.{step_index}{suffix}")

