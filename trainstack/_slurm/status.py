"""`trainstack status`, `logs` and `cancel`: what became of submitted jobs, on clusters with or without accounting.

Slurm is asked first (``squeue`` for the list, ``scontrol`` for one job: running, pending and recently ended
jobs), then ``sacct`` where accounting works, then the job folder's own record (``started``, ``exit_code``,
``cancelled``, written by the job script), so a job Slurm has forgotten still gets a clear answer. Torch-free.
"""

from __future__ import annotations

import datetime
import getpass
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .._common import jobevents as events
from .._common.files import SMALL, read_back_text
from .._common.jobfiles import DRIVER_QUIET_S, JobFiles, rank_log
from . import index
from .jobfolder import JobPaths
from .jobs import JobError, JobInfo, check_job_id, job_folder, job_infos
from .progress import Progress, progress_of

__all__ = ["TaskStatus", "job_status", "my_jobs", "format_table", "find_log", "follow_log", "cancel_job",
           "wait_for", "exit_status", "ENDED", "slurm_problem", "pending_note"]

#: States after which nothing more happens to a job (a requeued job passes through none of them for long).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED", "NEVER RAN", "ENDED")
# a Trainer's live or epoch line ("epoch 2/10 | step 150/400 | loss ..."), or qadence's "Iteration N | ..."
_METRIC = re.compile(r"(?:epoch \d+(?:\.\d+)?(?:/\d+)? \| step \d+(?:/\d+)?|Iteration\s+\d+) \|.*")


@dataclass
class TaskStatus:
    """One row of `trainstack status`: a job, or one task of an array job."""

    job: str
    name: str
    state: str
    nodes: str
    elapsed: str
    restarts: int
    metric: str
    source: str  # squeue, scontrol, sacct or folder: who answered
    log: Path | None = None
    folder: Path | None = None

    @property
    def ended(self) -> bool:
        return self.state.split(" (")[0] in ENDED

    @property
    def progress(self) -> Progress | None:
        """A running job's progress and ETA from its last live line (None otherwise)."""
        return progress_of(self.metric, self.log) if self.state == "RUNNING" and self.metric else None


def _record(base: str) -> dict | None:
    """The submission record of job ``base``; else a job folder ``logs/<name>-<id>`` or ``runs/...`` here."""
    for record in reversed(index.records()):
        if str(record["job_id"]) == base:
            return record
    for log_dir in (Path("logs"), Path("runs")):
        for folder in sorted(log_dir.glob(f"*-{base}")) if log_dir.is_dir() else []:
            files = JobFiles(folder)
            if files.has_script() or files.has_started():
                meta = _read_json(files.path(JobFiles.METADATA))
                return {"job_id": base, "name": meta.get("job_name") or folder.name[: -len(base) - 1],
                        "job_dir": str(folder.resolve()), "log_dir": str(log_dir.resolve()),
                        "tasks": [t["index"] for t in meta.get("tasks", [])]}
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(read_back_text(path, SMALL, owner=None, quiet=True) or "{}")
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def last_metric(log: Path | None) -> str:
    """The last ``epoch E | step S | loss ...`` (or ``Iteration N | ...``) line of a log (read from its tail only)."""
    try:
        if log is None or not log.is_file():
            return ""
        with open(log, "rb") as fh:
            fh.seek(max(0, log.stat().st_size - 65536))
            tail = fh.read().decode("utf-8", errors="replace")
    except OSError:  # another user's log, or one that just went away
        return ""
    found = _METRIC.findall(tail)
    return found[-1].strip() if found else ""


def _from_slurm(info: JobInfo) -> TaskStatus:
    folder = job_folder(info)
    log = Path(info.stdout) if info.stdout and "4294967294" not in info.stdout else None
    state = closed_state(info.state, folder)
    silent = JobFiles(folder).driver.silent_for() if folder is not None and state == "RUNNING" else None
    if state == "PENDING" and info.reason and info.reason != "None":
        state = f"PENDING ({info.reason})"
    elif silent is not None and silent > DRIVER_QUIET_S:  # the batch host lost? nothing of the job runs
        state = f"RUNNING (no driver for {silent:.0f} s)"
    elif state not in ("RUNNING", "COMPLETED") and info.exit_code not in (None, "0:0"):
        state = f"{state} (exit {info.exit_code})"
    return TaskStatus(info.label, info.name, state, str(info.num_nodes or info.nodes), info.elapsed,
                      info.restarts, last_metric(log), "scontrol", log, folder)


def closed_state(state: str, folder: Path | None) -> str:
    """Slurm's state, or the job's own where its driver ended it: a driver that took a lost batch host's place ends
    the job with ``scancel`` (nothing else would: its batch script is gone), after recording the run's exit status
    -- the job then completed or failed as that status says, not "CANCELLED" (``takeover.py``)."""
    if not state.startswith("CANCELLED") or folder is None or JobFiles(folder).cancelled():
        return state
    closed = events.read(folder, kind="job_closed")
    starts = events.read(folder, kind="job_start")
    if not closed or (starts and starts[-1].get("time", 0) > closed[-1].get("time", 0)):
        return state
    status = closed[-1].get("status")
    return "COMPLETED" if status == 0 else f"FAILED (exit {status}; ended by the driver that took the batch " \
        f"host's place)"


def _sacct(job_id: str) -> list[TaskStatus] | None:
    """Rows from accounting; None where accounting is off or does not know the job."""
    if shutil.which("sacct") is None:
        return None
    proc = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "--format=JobID,JobName,State,NNodes,Elapsed,"
                           "ExitCode"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return None
    rows = []
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 6:
            job, name, state, nodes, elapsed, code = parts
            if state.split(" ")[0] not in ("COMPLETED", "RUNNING", "PENDING") and code != "0:0":
                state = f"{state} (exit {code})"
            rows.append(TaskStatus(job, name, state, nodes, elapsed, 0, "", "sacct"))
    return rows or None


def _folder_state(folder: Path, parent: Path) -> str:
    files = JobFiles(folder)
    code = files.exit_code()
    if files.path(JobFiles.CANCELLED).exists():
        return "CANCELLED"
    if code is not None:
        if code == "143":  # the batch shell's TERM trap: scancel, the time limit or a preemption, never success
            return "ENDED (exit 143, SIGTERM: scancel, the time limit or a preemption)"
        return "COMPLETED" if code == "0" else f"FAILED (exit {code})"
    if JobFiles(parent).path(JobFiles.CANCELLED).exists():
        return "CANCELLED"
    if files.has_started():
        return "ENDED (killed: no exit status recorded)"
    return "NEVER RAN"


def _folder_record(folder: Path) -> tuple[str, int, str]:
    """(elapsed, restarts, nodes) of a job Slurm has forgotten, as Slurm told them: from the driver's timeline, the
    last attempt's start to its end (all its job steps), the requeues (not the retries inside an allocation), the
    allocation's node count; from ``started`` for a job folder without a timeline."""
    files = JobFiles(folder)
    starts = [e for e in events.read(folder) if e.get("kind") == "job_start"]
    if starts:
        last = starts[-1]
        end = next((e["time"] for e in events.read(folder, last["time"], "job_end")), None)
        seconds = int((end if end is not None else (files.exit_code_time() or last["time"])) - last["time"])
        return str(datetime.timedelta(seconds=max(0, seconds))), len(starts) - 1, str(last.get("nnodes") or "")
    if not files.has_started():
        return "", 0, ""
    lines = files.starts()
    try:
        first = datetime.datetime.fromisoformat(lines[-1]).timestamp()
        seconds = int((files.exit_code_time() or files.started_time() or first) - first)
    except (ValueError, IndexError):
        return "", max(0, len(lines) - 1), ""
    return str(datetime.timedelta(seconds=max(0, seconds))), max(0, len(lines) - 1), ""


def _from_folder(base: str, record: dict, task: str | None) -> list[TaskStatus]:
    job_dir = Path(record["job_dir"])
    name = str(record.get("name", ""))
    paths = JobPaths(Path(record.get("log_dir") or job_dir.parent), name, base)
    tasks = [int(t) for t in record.get("tasks") or []]
    if task is not None:
        tasks = [int(task)]
    units = [(f"{base}_{t}", paths.task_paths(t)) for t in tasks] if tasks else [(base, paths)]
    rows = []
    for label, unit in units:
        folder, log = job_dir / unit.folder.relative_to(paths.job_folder), unit.log
        elapsed, restarts, nodes = _folder_record(folder)
        rows.append(TaskStatus(label, name, _folder_state(folder, job_dir), nodes, elapsed, restarts,
                               last_metric(log), "folder", log if log.exists() else None,
                               folder if folder.is_dir() else None))
    return rows


def _pending_tasks(label: str) -> list[int]:
    """The task indices of a pending range's label (``123_[2-3,7]`` -> 2, 3, 7; a throttle ``%2`` is dropped)."""
    inside = label.partition("_[")[2].rstrip("]").split("%")[0]
    out: list[int] = []
    for part in inside.split(",") if inside else []:
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            out += range(int(low), int(high or low) + 1)
    return out


def _with_ended_tasks(base: str, rows: list[TaskStatus]) -> list[TaskStatus]:
    """An array's rows from Slurm, completed with the tasks Slurm already forgot (ended longer than its MinJobAge
    ago) from accounting, else from the job folder; in task order."""
    record = _record(base)
    if record is None or not record.get("tasks"):
        return rows
    have = {r.job for r in rows} | {f"{base}_{t}" for r in rows for t in _pending_tasks(r.job)}
    if {f"{base}_{t}" for t in record["tasks"]} <= have:
        return rows
    forgotten = [r for r in _from_folder(base, record, None) if r.job not in have]
    accounted = {r.job: r for r in _with_folder_facts(_sacct(base) or [], forgotten)}
    return sorted(rows + [accounted.get(r.job, r) for r in forgotten], key=_task_order)


def _with_folder_facts(rows: list[TaskStatus], folder_rows: list[TaskStatus]) -> list[TaskStatus]:
    """Accounting's rows with what only the job folder knows: the log, the restarts, the last metric."""
    by_label = {r.job: r for r in folder_rows}
    for row in rows:
        mine = by_label.get(row.job)
        if mine is not None:
            row.log, row.folder, row.metric, row.restarts = mine.log, mine.folder, mine.metric, mine.restarts
            row.state = closed_state(row.state, mine.folder)
    return rows


def _task_order(row: TaskStatus) -> int:
    task = row.job.rpartition("_")[2]
    return int(task) if task.isdigit() else (_pending_tasks(row.job) or [-1])[0]


def job_status(job_id: str) -> list[TaskStatus]:
    """One row per job (per task of an array job): Slurm, then accounting, then the job folder."""
    check_job_id(job_id)
    base, _, task = job_id.partition("_")
    slurm_problem = ""
    try:
        infos = job_infos(job_id)
    except JobError as exc:  # no scontrol here, or no controller: the job folder may still know
        infos, slurm_problem = [], f" ({str(exc).splitlines()[0].split('. HINT')[0]})"
    if task:
        if infos and all(i.array_job_id is None for i in infos):
            raise JobError(f"job {base} is not an array job, so it has no task {task}. HINT: trainstack status "
                           f"{base}")
        infos = [i for i in infos if i.label == job_id] or infos[:0]
    if infos:
        live = [_from_slurm(i) for i in infos]
        return _with_ended_tasks(base, live) if not task and any(i.array_job_id for i in infos) else live
    record = _record(base)
    if task and record is not None and not record.get("tasks"):
        raise JobError(f"job {base} is not an array job, so it has no task {task}. HINT: trainstack status {base}")
    rows = _sacct(job_id)
    if rows is not None:
        return _with_folder_facts(rows, _from_folder(base, record, task or None) if record is not None else [])
    if record is not None:
        return _from_folder(base, record, task or None)
    if slurm_problem:
        raise JobError(f"job {job_id}: Slurm is not available here{slurm_problem}, and no job folder records it. "
                       f"HINT: run trainstack on the cluster's login node.")
    raise JobError(f"job {job_id} is unknown: Slurm does not know it (not queued, running or recently ended), "
                   f"accounting does not answer, and no job folder records it. HINT: `trainstack status` lists "
                   f"the jobs you submitted with trainstack.")


def pending_note(job_id: str, folder: Path | None) -> str | None:
    """Why a pending job that already ran waits: what ended its last attempt (at which step) and Slurm's hold on a
    requeued job (BeginTime: until when)."""
    from .attempt import history
    from .jobs import job_info

    info = job_info(job_id)
    if info is None or info.state != "PENDING" or not info.restarts:
        return None
    rows = history(folder) if folder is not None else []
    last = rows[-1] if rows else None
    ended = f"after {last['cause']} at step {last.get('step')}" if last else "after an attempt ended"
    held = f"; Slurm holds it until {info.start_time.replace('T', ' ')} (BeginTime: a requeued job waits " \
           f"before it may start again)" if info.reason == "BeginTime" and info.start_time else \
        f"; waiting for resources ({info.reason})" if info.reason and info.reason != "None" else ""
    resume = f"; it resumes from its last checkpoint (step {last.get('step')} or before)" if last and \
        last.get("step") is not None else ""
    return f"requeued (restart {info.restarts}) {ended}{held}{resume}"


def slurm_problem() -> str | None:
    """Why Slurm cannot be asked here (no client commands, no controller), or None when it answers."""
    if shutil.which("squeue") is None or shutil.which("scontrol") is None:
        return "no squeue/scontrol on PATH"
    proc = subprocess.run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%A"], capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        return f"squeue failed: {lines[-1].strip() if lines else proc.returncode}"
    return None


def my_jobs(limit: int = 20) -> list[TaskStatus]:
    """This user's live jobs (squeue) and the last ``limit`` jobs trainstack submitted, newest first."""
    live: dict[str, list[TaskStatus]] = {}
    if shutil.which("squeue") is not None:
        # %F: an array task's array job id (every task listed once, under its array), a plain job's own id
        proc = subprocess.run(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%F"], capture_output=True,
                              text=True, timeout=30)
        for base in dict.fromkeys(proc.stdout.split() if proc.returncode == 0 else []):
            if base.isdigit():
                live[base] = []
    for record in index.records()[-limit:]:
        live.setdefault(str(record["job_id"]), [])
    rows: list[TaskStatus] = []
    for base in sorted(live, key=int, reverse=True):
        try:
            rows += job_status(base)
        except JobError:
            continue  # a record of a job that left no trace: nothing to show
    return rows


def format_table(rows: list[TaskStatus]) -> str:
    """A plain table (fixed columns; a running job's progress and ETA; the metric line last, cut to the
    terminal)."""
    header = ("JOB", "NAME", "STATE", "NODES", "ELAPSED", "RESTARTS", "PROGRESS", "LAST METRIC")
    data = [(r.job, r.name, r.state, r.nodes, r.elapsed, str(r.restarts), _progress_cell(r), r.metric) for r in rows]
    widths = [max(len(row[i]) for row in [header, *data]) for i in range(len(header) - 1)]
    width = shutil.get_terminal_size((160, 20)).columns
    lines = []
    for row in [header, *data]:
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        lines.append(line.rstrip()[:max(width, 80)])
    return "\n".join(lines)


def _progress_cell(row: TaskStatus) -> str:
    progress = row.progress
    return progress.cell() if progress is not None else ""


def find_log(job_id: str, rank: int | None = None) -> tuple[Path, TaskStatus]:
    """The combined log of a job (or array task), or one rank's log from its job folder."""
    rows = job_status(job_id)
    if len(rows) > 1:
        raise JobError(f"job {job_id} is an array of {len(rows)} tasks; name one, e.g. `trainstack logs "
                       f"{rows[0].job if rows[0].job[-1].isdigit() else job_id + '_0'}`.")
    row = rows[0]
    if row.state.startswith("PENDING"):
        raise JobError(f"job {row.job} is {row.state}: it has not started, so there is no log yet. HINT: "
                       f"`trainstack logs {row.job} --follow` waits for it.")
    if rank is None:
        if row.log is None or not row.log.exists():
            raise JobError(f"job {row.job} ({row.state}) has no log file{f' at {row.log}' if row.log else ''}.")
        return row.log, row
    if row.folder is None:
        raise JobError(f"job {row.job} has no job folder, so no per-rank logs: its script was not generated by "
                       f"trainstack, or the folder (<log dir>/<job name>-<job id>) was deleted. HINT: `trainstack "
                       f"logs {row.job}` shows the combined log.")
    path = row.folder / rank_log(rank)
    if not path.exists():
        have = sorted(p.stem for p in row.folder.glob("*.out"))
        raise JobError(f"job {row.job} has no log for rank {rank} in {row.folder}; it has: "
                       f"{', '.join(have) or 'none'}.")
    return path, row


def follow_log(job_id: str, rank: int | None, echo: Callable[[str], None], poll: float = 1.0,
               timeout: float | None = None, offset: int = 0) -> TaskStatus:
    """Print the log as it grows (from byte ``offset``: a reconnecting remote follower) until the job ends (waiting
    for a pending job to start); return its last row."""
    deadline = None if timeout is None else time.monotonic() + timeout
    path: Path | None = None
    holds = RequeueHolds()
    while True:
        holds.release(job_id)
        rows = job_status(job_id)
        row = rows[0]
        if path is None and not row.state.startswith("PENDING"):
            try:
                path, row = find_log(job_id, rank)
            except JobError:
                if row.ended:
                    raise
        for chunk in _read_from(path, offset):
            offset += len(chunk.encode("utf-8"))
            echo(chunk)
        if row.ended:
            time.sleep(poll)  # the last lines may still be on their way through the file system
            for chunk in _read_from(path, offset):
                echo(chunk)
            return row
        if deadline is not None and time.monotonic() > deadline:
            return row
        time.sleep(poll)


def _read_from(path: Path | None, offset: int) -> Iterator[str]:
    if path is None or not path.is_file():  # never a FIFO someone put in its place
        return
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        fh.seek(offset)
        text = fh.read()
    if text:
        yield text


def cancel_job(job_id: str) -> list[str]:
    """``scancel`` a queued or running job (or array task); mark its job folder; return what was cancelled."""
    check_job_id(job_id)
    infos = [i for i in job_infos(job_id) if i.state not in ENDED]
    if "_" in job_id:
        infos = [i for i in infos if i.label == job_id or i.label.startswith(job_id.split("_")[0] + "_[")]
    if not infos:
        try:
            rows = job_status(job_id)
        except JobError:
            raise JobError(f"job {job_id} is unknown to Slurm and to trainstack: nothing to cancel. HINT: "
                           f"`trainstack status` lists your jobs.") from None
        states = ", ".join(sorted({r.state for r in rows}))
        raise JobError(f"job {job_id} is not queued or running ({states}): nothing to cancel.")
    if shutil.which("scancel") is None:
        raise JobError("scancel not found on PATH. HINT: run this on a Slurm login node.")
    for info in infos:
        info.check_mine("cancel")
    marks = []  # first, so a job script with --requeue sees it and does not requeue itself
    for info in infos:
        folder = job_folder(info)
        if folder is None and info.paths is not None and "_" not in job_id:  # pending tasks: the array's folder
            parent = info.paths.job_folder
            folder = parent if parent.is_dir() else None
        if folder is not None:
            marks.append(JobFiles(folder).path(JobFiles.CANCELLED))
            marks[-1].write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z\n"))
    proc = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        for mark in marks:
            mark.unlink(missing_ok=True)
        raise JobError(f"scancel {job_id} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return [i.label for i in infos]


def exit_status(state: str) -> int:
    """0 for COMPLETED; else the exit status in ``STATE (exit N)`` / ``(exit N:S)`` (128+S for a signal), or 1."""
    if state == "COMPLETED":
        return 0
    m = re.search(r"\(exit (\d+)(?::(\d+))?[),]", state)
    if not m:
        return 1
    code, sig = int(m.group(1)), int(m.group(2) or 0)
    return code or (128 + sig if sig else 1)


class RequeueHolds:
    """Slurm holds a requeued job for its credential lifetime (~2 min, reason BeginTime) before it may start again;
    a trainstack job's batch script releases it when it can, but Slurm sets the hold only once that script has
    ended. Whoever follows the job (``submit --wait``, ``status --wait``) releases the hold on its own requeued job
    3 s after it appears (slurmd refuses a launch whose credential is from the second of the revocation)."""

    def __init__(self, after_s: float = 3.0) -> None:
        self.after_s, self.seen = after_s, dict[str, float]()

    def release(self, job_id: str) -> list[str]:
        """Release the held, requeued jobs among ``job_id`` (every task of an array) held for ``after_s`` or more;
        the released ones."""
        now, released = time.monotonic(), []
        try:
            infos = job_infos(job_id)
        except JobError:
            return []
        for info in infos:
            label = info.label
            if not (info.state == "PENDING" and info.reason == "BeginTime" and info.restarts):
                self.seen.pop(label, None)
            elif now - self.seen.setdefault(label, now) >= self.after_s:
                done = subprocess.run(["scontrol", "update", f"JobId={label}", "StartTime=now"], capture_output=True,
                                      text=True, timeout=30)
                if done.returncode == 0:
                    released.append(label)
                self.seen.pop(label)
        return released


def wait_for(job_id: str, log_path: Path | None, echo: Callable[[str], None] | None = None,
             timeout: float | None = None, poll: float = 0.5, cancel: bool = True) -> tuple[int, str]:
    """Follow the job's log until it (every array task) ends; return its exit code (non-zero for any failure) and
    final state. Slurm answers while it knows the job; after that, the job folder's record does. Past ``timeout``
    the job is cancelled (a JobError), or with ``cancel=False`` left running (TimeoutError)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    offset, holds = 0, RequeueHolds()
    while True:
        holds.release(job_id)
        rows = job_status(job_id)
        if echo and log_path is not None and log_path.exists():
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                fh.seek(offset)
                chunk = fh.read()
                offset = fh.tell()
            if chunk:
                echo(chunk)
        if all(r.ended for r in rows):
            time.sleep(1.0)  # a requeue passes through terminal-looking states: believe only a stable one
            rows = job_status(job_id) or rows
            if all(r.ended for r in rows):
                state = rows[0].state if len(rows) == 1 else ", ".join(sorted({r.state for r in rows}))
                return max(exit_status(r.state) for r in rows), state
        if deadline is not None and time.monotonic() > deadline:
            if not cancel:
                raise TimeoutError(job_id)
            subprocess.run(["scancel", job_id], timeout=30)
            raise JobError(f"job {job_id} did not finish within {timeout:.0f}s; cancelled it.")
        time.sleep(poll)
