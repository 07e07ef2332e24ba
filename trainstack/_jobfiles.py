"""The job folder's contents, owned here: every file name inside ``<log dir>/<name>-<job id>/`` and the one way to
read or write each. The allocation driver, the verdicts, ``status``, the attempt reports, the goodput ledger, the
watchdog, the graceful stop and the memory checkpoints all go through ``JobFiles``; no other module spells a name.
``JobPaths`` (``_slurm/jobfolder.py``) owns where the folder is, this module what is in it. Torch-free leaf.

The one writer that is not Python is ``EXIT_RECORD_SH``: the bash wrapper every Slurm task runs in, which records a
failing task's end (when, status, task, host) in ``exits/`` for the driver to read.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _envvars as envvars
from ._files import read_jsonl

__all__ = ["JobFiles", "Exit", "EXIT_RECORD_SH", "DRIVER_SILENT_S", "DRIVER_QUIET_S"]


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
  "$@" 2>&1 | (trap "" USR1 USR2 TERM INT HUP; exec tee -a "$log")
  rc=${PIPESTATUS[0]}
else
  "$@"
  rc=$?
fi
if [[ "$rc" -ne 0 ]]; then
  mkdir -p "$TRAINSTACK_JOB_DIR/exits" 2>/dev/null
  step=$(cat "$TRAINSTACK_JOB_DIR/steps/$(hostname)-$$" 2>/dev/null) || step=${TRAINSTACK_STEP:-0}
  echo "$(date +%s.%N) $rc $unit ${SLURMD_NODENAME:-$(hostname)} $step" \
    > "$TRAINSTACK_JOB_DIR/exits/$unit" 2>/dev/null
fi
exit "$rc"'''

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
    """One job folder (an array task's own folder) and everything in it, by name."""

    folder: Path

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
        return cls(Path(folder)) if folder else None

    def path(self, name: str) -> Path:
        return self.folder / name

    # ------------------------------------------------------------------ runs and the job's end
    def submitted_code(self) -> dict[str, Any]:
        """The submission's git record (``commit``, ``dirty``) from trainstack submit's metadata ({} without one)."""
        try:
            return dict(json.loads(self.path(self.METADATA).read_text()).get("git") or {})
        except (OSError, ValueError, AttributeError):
            return {}

    def mark_started(self) -> None:
        with open(self.path(self.STARTED), "a") as fh:
            fh.write(datetime.datetime.now().astimezone().isoformat(timespec="seconds") + "\n")

    def starts(self) -> list[str]:
        return [line.strip() for line in _read(self.path(self.STARTED)).splitlines() if line.strip()]

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
        return self.path(self.STARTED).exists()

    def write_exit_code(self, status: int) -> None:
        try:
            self.path(self.EXIT_CODE).write_text(f"{status}\n")
        except OSError:  # a folder deleted meanwhile must not turn success into failure
            pass

    def clear_exit_code(self) -> None:
        self.path(self.EXIT_CODE).unlink(missing_ok=True)

    def exit_code(self) -> str | None:
        """The recorded exit status (its last line), or None when the job never wrote one."""
        lines = _read(self.path(self.EXIT_CODE)).strip().splitlines()
        return lines[-1].strip() if lines else None

    def exit_code_time(self) -> float | None:
        try:
            return self.path(self.EXIT_CODE).stat().st_mtime
        except OSError:
            return None

    def started_time(self) -> float | None:
        try:
            return self.path(self.STARTED).stat().st_mtime
        except OSError:
            return None

    def mark_attempt_in_logs(self, label: str) -> None:
        """``=== trainstack: attempt LABEL starts at ...`` in every rank and node log already there."""
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        for log in [*self.folder.glob("rank-*.out"), *self.folder.glob("node-*.out")]:
            try:
                with open(log, "a") as fh:
                    fh.write(f"{ATTEMPT_MARK}{label} starts at {stamp}\n")
            except OSError:
                pass

    # ------------------------------------------------------------------ one job step's failures
    def clear_step(self) -> None:
        """Before a job step: no exit record, lost node or next-step offer of the one before (this step's offer is
        written after)."""
        import shutil

        shutil.rmtree(self.path(self.EXITS), ignore_errors=True)
        shutil.rmtree(self.path(self.PEERS_LOST), ignore_errors=True)
        shutil.rmtree(self.path(self.REJOIN), ignore_errors=True)  # a requeued job counts its steps from 0 again
        self.path(self.LOST).unlink(missing_ok=True)

    def exits(self, step: int | None = None) -> list[Exit]:
        """The failing tasks of job step ``step`` (None: of the newest step any record names), first first. A task
        of the step before that dies after the next one started (its remains are killed, not waited for) records
        its step, so it never reads as the new step's failure."""
        found = []
        folder = self.path(self.EXITS)
        for path in sorted(folder.glob("*")) if folder.is_dir() else []:
            parts = _read(path).split()
            try:
                found.append(Exit(float(parts[0]), int(parts[1]), parts[2], parts[3],
                                  int(parts[4]) if len(parts) > 4 else None))
            except (IndexError, ValueError):
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
            folder = self.path(self.PEERS_LOST)
            folder.mkdir(exist_ok=True)
            mark = " waiting" if waiting else ""
            (folder / f"rank-{rank}").write_text(f"{time.time():.3f} {step} {host}{mark}\n")
        except OSError:
            pass

    def waiting(self, step: int) -> dict[int, str]:
        """The ranks of job step ``step`` waiting in place for the next step, each with its host."""
        folder, found = self.path(self.PEERS_LOST), {}
        for path in folder.glob("rank-*") if folder.is_dir() else []:
            parts = _read(path).split()
            if len(parts) > 3 and parts[3] == "waiting" and parts[1] == str(step) and path.name[5:].isdigit():
                found[int(path.name[5:])] = parts[2]
        return found

    def offer_rejoin(self, step: int, env: dict[str, str], ranks: list[int], per_node: int) -> None:
        """The next job step ``step``, for the ``ranks`` waiting in place (each keeps its rank; ``per_node`` ranks
        per node): the environment they take (rendezvous, counters, sizes) before they join its process group;
        written whole (a reader never sees half of it)."""
        folder = self.path(self.REJOIN)
        folder.mkdir(exist_ok=True)
        tmp = folder / f".step-{step}.{os.getpid()}"
        tmp.write_text(json.dumps({"step": step, "env": env, "ranks": ranks, "per_node": per_node}))
        os.replace(tmp, folder / f"step-{step}.json")

    def rejoin_offer(self, after: int) -> dict[str, Any] | None:
        """The newest next-step offer for a step after ``after``, or None (yet)."""
        folder = self.path(self.REJOIN)
        steps = [int(p.name[5:-5]) for p in folder.glob("step-*.json") if p.name[5:-5].isdigit()] \
            if folder.is_dir() else []
        newer = [n for n in steps if n > after]
        if not newer:
            return None
        try:
            return dict(json.loads(_read(folder / f"step-{max(newer)}.json")))
        except ValueError:
            return None

    def note_step(self, host: str, wrapper_pid: int, step: int) -> None:
        """A rank restarted in place is now in job step ``step``: its task's wrapper records a failure under it."""
        folder = self.path(self.STEPS)
        folder.mkdir(exist_ok=True)
        (folder / f"{host}-{wrapper_pid}").write_text(str(step))

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
        folder = self.path(self.PEERS_LOST)
        found = []
        for path in folder.glob("rank-*") if folder.is_dir() else []:
            parts = _read(path).split()
            try:
                if step is None or int(parts[1]) == step:
                    found.append((float(parts[0]), parts[2] if len(parts) > 2 else "", int(path.name[5:])))
            except (IndexError, ValueError):
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
        self.path(self.LOST).write_text(text)

    def lost(self) -> list[tuple[str, list[str]]]:
        rows = [line.split() for line in _read(self.path(self.LOST)).splitlines() if line.strip()]
        return [(row[0], row[1].split(",") if len(row) > 1 else []) for row in rows]

    # ------------------------------------------------------------------ the user's cancel
    def cancel(self) -> None:
        self.path(self.CANCELLED).touch()

    def cancelled(self) -> bool:
        """``trainstack cancel`` marked this folder (or, for an array task, the whole array's)."""
        return self.path(self.CANCELLED).exists() or \
            (self.folder.name.startswith("task-") and (self.folder.parent / self.CANCELLED).exists())

    # ------------------------------------------------------------------ the graceful stop
    @property
    def stop_file(self) -> Path:
        return self.path(self.STOP)

    def request_stop(self) -> None:
        try:
            self.stop_file.touch()
        except OSError:
            pass

    def stop_answers(self) -> tuple[bool, bool]:
        """(saved, finished): the trainer checkpointed for a stop; the run had ended before a stop came."""
        return Path(f"{self.stop_file}.saved").exists(), Path(f"{self.stop_file}.finished").exists()

    def clear_stop(self) -> None:
        for suffix in ("", ".saved", ".finished"):
            Path(f"{self.stop_file}{suffix}").unlink(missing_ok=True)

    @staticmethod
    def confirm_saved(stop_file: str, checkpoint: Path | None) -> None:
        """The trainer's answer to a stop request: its checkpoint is complete."""
        Path(stop_file + ".saved").write_text(str(checkpoint or ""))

    @staticmethod
    def confirm_finished(stop_file: str, step: int) -> None:
        """The trainer's note that its run finished with its final checkpoint."""
        try:
            Path(stop_file + ".finished").write_text(f"{step}\n")
        except OSError:
            pass

    # ------------------------------------------------------------------ node checks
    @property
    def node_check_dir(self) -> Path:
        return self.path(self.NODE_CHECK)

    def node_check_figures(self, host: str) -> Any:
        return _json(self.node_check_dir / f"{host}.json")

    def node_check_links(self) -> Any:
        return _json(self.node_check_dir / "links.json")

    def node_checks(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path(self.NODE_CHECKS))

    def append_node_check(self, record: dict[str, Any]) -> None:
        self._append(self.NODE_CHECKS, record)

    # ------------------------------------------------------------------ verdicts and events
    def verdicts(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path(self.VERDICTS))

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
        with open(self.path(name), "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    # ------------------------------------------------------------------ what the training side leaves
    def write_progress(self, step: int) -> None:
        tmp = self.path(f".{self.PROGRESS}.{os.getpid()}")
        tmp.write_text(json.dumps({"step": step, "time": time.time()}))
        os.replace(tmp, self.path(self.PROGRESS))

    def progress_step(self) -> int | None:
        found = _json(self.path(self.PROGRESS))
        return int(found["step"]) if isinstance(found, dict) and isinstance(found.get("step"), int) else None

    def write_run_folder(self, folder: Path) -> None:
        self.path(self.RUN_FOLDER).write_text(f"{folder.resolve()}\n")

    def run_folder(self) -> str:
        return _read(self.path(self.RUN_FOLDER)).strip()

    @property
    def ledger_dir(self) -> Path:
        return self.path(self.LEDGER)

    def record_memory_folder(self, folder: Path) -> None:
        """A /dev/shm folder of memory checkpoints the driver frees on every node at the job's end."""
        known = self.memory_folders()
        if str(folder) not in known:
            with open(self.path(self.MEMORY_FOLDERS), "a") as fh:
                fh.write(f"{folder}\n")

    def memory_folders(self) -> list[str]:
        return [line for line in _read(self.path(self.MEMORY_FOLDERS)).splitlines() if line.strip()]

    def forget_memory_folders(self) -> None:
        self.path(self.MEMORY_FOLDERS).unlink(missing_ok=True)

    # ------------------------------------------------------------------ the driver
    def beat(self) -> None:
        """The driver is alive (the heartbeat's mtime)."""
        try:
            self.path(self.ALIVE).touch()
        except OSError:
            pass

    def driver_silent_for(self, now: float | None = None) -> float | None:
        """Seconds since the driver's last heartbeat (None: it never beat, or it ended)."""
        if self.path(self.DRIVER_END).exists():
            return None
        try:
            return (now or time.time()) - self.path(self.ALIVE).stat().st_mtime
        except OSError:
            return None

    def driver_ended(self, why: str) -> None:
        try:
            self.path(self.DRIVER_END).write_text(why + "\n")
        except OSError:
            pass

    def driver_started(self) -> None:
        self.path(self.DRIVER_END).unlink(missing_ok=True)
        self.beat()

    def has_script(self) -> bool:
        return self.path(self.SCRIPT).exists()

    def report(self, restart: int, step_index: int, suffix: str) -> Path:
        """The attempt report of job step ``restart.step_index`` (``.txt`` or ``.json``)."""
        return self.path(f"attempt-{restart}.{step_index}{suffix}")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
