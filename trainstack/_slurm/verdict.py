"""Why did a job end? A verdict from what the job already left behind -- Slurm's state, the job folder's
``exit_code``/``cancelled``, the per-rank logs, the hang watchdog's ``SUMMARY.txt`` -- at no cost to the run.

Only the current attempt's evidence counts: the rank logs after the attempt's marker, the combined log after its
header, the ``exits/`` records of its step, the job's ``events.jsonl`` and hang reports newer than its start. The
first failing rank is the one that failed first (the task wrapper records when each failing task ended) with a
*primary* error: after one rank fails, the others die of collective errors (connection closed, timeouts) or of the
launcher's kill; those are evidence of the cascade, not the cause. Classes come from trainstack's own records and
from anchored patterns of torch, NCCL and CUDA messages, never from any text a program prints. Torch-free.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .._common import jobevents as events
from .._common import transport as _transport
from .._common.files import read_back_text
from .._common.jobfiles import (
    ATTEMPT_MARK,
    DRIVER_QUIET_S,
    DRIVER_SILENT_S,
    RANK_LOG_RE,
    Exit,
    JobFiles,
    rank_log,
    rank_unit,
)

__all__ = ["Verdict", "verdict", "KINDS", "HOST_FAULTS", "last_step", "exit_records"]

KINDS = ("completed", "cancelled", "preempted", "time limit", "hang", "cuda out-of-memory", "cuda error",
         "killed (signal 9)", "crashed (signal)", "collective failure", "node failure", "nccl transport", "superseded",
         "driver died", "python error", "exited", "running", "unknown")
#: Verdicts that blame the machine, not the program: a requeue leaves the host out.
HOST_FAULTS = ("cuda error", "node failure")

_TRACE_END = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Error\w*|StaleLease|Conflict))"
                        r"(?::\s*(?P<msg>.*))?$")  # trainstack's StaleLease, LeaseConflict end a traceback too
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')
# torch's distributed exception types, and the messages gloo and NCCL raise through RuntimeError
_COLLECTIVE_TYPE = re.compile(r"(?:torch\.distributed\.)?Dist(?:Backend|Network|Store)Error$")
_COLLECTIVE = re.compile(r"gloo/transport/|\[[^]]*gloo[^]]*\]|ProcessGroupGloo|ProcessGroupNCCL|"
                         r"Connection closed by peer|Connection reset by peer|"
                         r"Watchdog caught collective operation timeout|NCCL (?:error|communicator was aborted)")
_CUDA_OOM = re.compile(r"(?:torch\.)?(?:cuda\.)?OutOfMemoryError$|^CUDA out of memory")
# a GPU or driver fault; a device-side assert or an invalid argument is the program's
_CUDA_FAULT = re.compile(r"CUDA error: (?:an illegal memory access|uncorrectable ECC|unspecified launch failure|"
                         r"misaligned address|an illegal instruction|the launch timed out|"
                         r"unknown error|ECC error)|CUDA driver error|\bXid \d+\b|NCCL error.*unhandled cuda error")
_SIGKILL = re.compile(r"killed by SIGKILL|oom-kill|OUT_OF_MEMORY|exit code 137\b|^Killed$",
                      re.IGNORECASE | re.MULTILINE)
_GRACEFUL = re.compile(r"^Graceful stop at epoch \d+, step \d+|^Interrupted at epoch \d+, step \d+", re.MULTILINE)
_NOT_REQUEUED = re.compile(r"^trainstack: stopped gracefully with a complete checkpoint \((\w+)\); not requeued",
                           re.MULTILINE)
_NCCL_NOT_FOUND = re.compile(r"Error ?: network (?P<net>.+?) not found")
_HANG_LINE = "trainstack hang report: no rank made progress for"
_JOB_HEADER = "=== trainstack job "  # the batch script's first line of each attempt in the combined log
_SRUN_EXIT = re.compile(r"^srun: error: (?P<host>\S+): tasks? (?P<task>\d+)(?:-\d+)?: "
                        r"(?:Exited with exit code (?P<code>\d+)|(?P<killed>Killed))", re.MULTILINE)
_SIGNALS = {4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 11: "SIGSEGV"}
_RANK_LOG = re.compile(RANK_LOG_RE)
_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_HINTS = {
    "cuda out-of-memory": ["a smaller per-process batch with more gradient_accumulation_steps",
                           "mixed_precision='bf16'", "strategy='fsdp' to shard parameters and optimizer state"],
    "killed (signal 9)": ["if the kernel or Slurm killed it for memory: fewer DataLoader workers, a smaller "
                          "in-memory dataset, or --mem; `sacct -j JOB -o MaxRSS` (where accounting works) shows the "
                          "peak", "if a person or a tool sent kill -9 (or a node agent), memory is not the cause: "
                          "the job's log and `dmesg` on the node tell which"],
    "collective failure": ["the first rank that stopped is the cause; the others timed out waiting for it",
                           "`trainstack debug JOB` while it runs, NCCL_DEBUG=INFO, and the host named here"],
    "hang": ["the stuck rank and its frame are in hang-*/SUMMARY.txt of the run or job folder",
             "`trainstack debug JOB` shows every rank's stack of a live job"],
    "time limit": ["--time longer, or --signal B:USR2@<seconds> (with --requeue) so the job checkpoints and "
                   "requeues before the limit"],
    "python error": ["a deterministic error fails the same way on every retry: fix it, then resume='auto'"],
    "cuda error": ["a requeued attempt leaves the host out (--requeue); `trainstack doctor` on that node",
                   "if it follows the job to every host, it is the program: CUDA_LAUNCH_BLOCKING=1 finds the kernel"],
    "node failure": ["--requeue runs the job again; Slurm drains the failed node (sinfo -R shows why)"],
    "driver died": ["the allocation driver (python -m trainstack._slurm.allocation) was killed or crashed: the OOM "
                    "killer (dmesg on the batch host), a kill, a bug -- its keeper lets a new driver take over the "
                    "allocation twice, then requeues the job; trainstack status --attempts JOB shows each death"],
    "superseded": ["another attempt of the run (another job, or another cluster) took its lease: this one stopped "
                   "without committing, so the run keeps one lineage; `trainstack status STORE_URL` shows the "
                   "attempts"],
    "nccl transport": ["`trainstack doctor --nccl-transport KIND` on the host named here says what is missing",
                       "in a container: the image needs the RDMA user space (the trainstack images carry it) and the "
                       "runtime must bring /dev/infiniband and the site's network plugin (docs/how-to/containers.md)",
                       "NCCL's own init lines: nccl.HOST.PID.log in the log folder"],
    "preempted": ["with --requeue the job continues from its checkpoint"],
    "exited": ["a program that exits with an error status on its own fails the same way again: fix it, then "
               "resume='auto' (--retry-on exited retries it)", "the rank's own log: trainstack logs JOB --rank N"],
    "crashed (signal)": ["a segfault or abort in native code: a library mismatch (the image vs the host), a bad "
                         "extension, or the hardware; PYTHONFAULTHANDLER=1 (set in trainstack jobs) prints the "
                         "Python stack"],
}


@dataclass
class Verdict:
    """One ended (or running) job's verdict: what, where, and the lines that say so."""

    kind: str
    summary: str
    rank: int | None = None
    host: str | None = None
    evidence: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"{self.kind}: {self.summary}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class Evidence:
    """What the current attempt left: its start, the rank logs and combined log since then, the job folder's
    recorded exit status, the failing tasks' exit records (first first) and trainstack's own events."""

    since: float = 0.0
    texts: dict[int, str] = field(default_factory=dict)
    combined: str = ""
    exit_code: list[str] = field(default_factory=list)
    exits: list[Exit] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, folder: Path | None, log: Path | None, status: int | None) -> Evidence:
        since = attempt_start(folder)
        combined = _read(log)
        at = combined.rfind("\n" + _JOB_HEADER)
        recorded = JobFiles(folder).exit_code() if folder else None
        code = [str(status)] if status is not None else ([recorded] if recorded is not None else [])
        return cls(since, _rank_texts(folder), combined[at + 1:] if at >= 0 else combined, code,
                   exit_records(folder) or _srun_exits(combined), events.read(folder, since))

    def event(self, kind: str) -> dict | None:
        found = [e for e in self.events if e.get("kind") == kind]
        return found[-1] if found else None


def _driver_died(folder: Path | None, ev: Evidence, asked_by_driver: bool) -> Verdict | None:
    """The allocation driver died and no new one ended the job: its keeper's record, or -- asked after the job's
    end, not by a living driver about its step -- a job that started and ended without the driver's end (the
    keeper itself was killed)."""
    died = ev.event("driver_died")
    if died is not None and died.get("takeover") is None:
        return Verdict("driver died", f"the allocation driver died ({died.get('why')}) more often than its keeper "
                                      f"lets a new one take over" + ("; the job was requeued" if died.get("requeued")
                                                                    else ""))
    files = JobFiles(folder) if folder is not None and not asked_by_driver else None
    if files is not None and files.has_started() and not files.driver.has_ended() and not files.cancelled() and \
            files.driver.silent_for() is not None:
        return Verdict("driver died", "the allocation driver died without ending the job (no driver.ended), and "
                                      "nothing took over: the job script's process itself was killed")
    return None


def _sentinel(folder: Path | None) -> str:
    """What will happen to a job whose driver fell silent: the sentinel's part (``sentinel.py``), as its events say."""
    kinds = {e.get("kind"): e for e in events.read(folder) if e.get("kind", "").startswith(("sentinel", "driver_lost"))}
    if "driver_lost_requeue_failed" in kinds:
        return f"the sentinel's requeue failed ({kinds['driver_lost_requeue_failed'].get('answer')}): trainstack " \
               f"cancel the job"
    if "sentinel_start" in kinds:
        return f"the sentinel on {kinds['sentinel_start'].get('host') or 'another node'} takes the driver's place " \
               f"once Slurm finds that host lost (or requeues the job without it after {DRIVER_SILENT_S:.0f} s " \
               f"of silence)"
    return "no sentinel watches it (one node, or no --requeue): trainstack cancel the job"


def verdict(state: str, folder: Path | None, log: Path | None, status: int | None = None) -> Verdict:
    """The verdict for a job in Slurm ``state`` with its job folder and combined log (either may be missing);
    ``status``: the launch's exit status when the caller knows it (the batch script, right after an attempt)."""
    base = state.split(" (")[0].split()[0] if state else "UNKNOWN"
    if base in ("RUNNING", "PENDING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED"):
        silent = JobFiles(folder).driver.silent_for() if folder is not None and base == "RUNNING" else None
        if silent is not None and silent > DRIVER_QUIET_S:
            return Verdict("running", f"the job holds its nodes but no process of it is known to run: its driver has "
                           f"not answered for {silent:.0f} s (its batch host lost?); {_sentinel(folder)}")
        return Verdict("running", f"the job is {base.lower()}")
    ev = Evidence.of(folder, log, status)
    if base == "COMPLETED":  # a requeued job's log also holds the failures of its earlier attempts
        return _stopped_early(ev.combined) or Verdict("completed", "the job ended with exit code 0")
    gone = _lost(folder, ev) or _silent(ev) or _driver_died(folder, ev, asked_by_driver=status is not None)
    if gone is not None:
        return _done(gone)
    hang = _hang(ev, folder)
    if hang is not None:
        return _done(Verdict("hang", hang[0], evidence=hang))
    if (folder is not None and JobFiles(folder).cancelled()) or base == "CANCELLED":
        return _done(Verdict("cancelled", "cancelled by the user (trainstack cancel / scancel)"))
    if base == "NODE_FAIL":
        down = _down_nodes()
        now = f" (down now: {', '.join(down)})" if down else ""
        return _done(Verdict("node failure", f"Slurm marked a node of the job as failed{now}",
                             host=down[0] if len(down) == 1 else None, evidence=_tail(ev.combined)))
    graceful = _graceful(ev)
    if base == "TIMEOUT":
        done = f"after a graceful stop ({graceful})" if graceful else "without a graceful stop (no checkpoint " \
            "was written at the limit)"
        return _done(Verdict("time limit", f"the time limit was reached {done}", evidence=_tail(ev.combined)))
    failed = _first_failure(ev, folder)
    if base == "PREEMPTED" or (graceful and "Interrupted" not in graceful and failed is None):
        return _done(Verdict("preempted", graceful or "preempted by Slurm"))
    if failed is not None and failed.kind != "collective failure":
        return _done(failed)
    first = ev.exits[0] if ev.exits else None
    if first is not None and (first.rank is None or _last_error(ev.texts.get(first.rank, "")) is None):
        ended = _ended_without_traceback(ev, first)  # the first task to end took no traceback with it
        if ended is not None:
            return _done(ended)
    if base == "OUT_OF_MEMORY" or (first is None and (_SIGKILL.search(ev.combined) or ev.exit_code == ["137"])):
        return _done(Verdict("killed (signal 9)", "a process was killed with signal 9: the kernel's OOM killer, "
                             "Slurm's memory limit or a kill -9", evidence=_matching(ev.combined, _SIGKILL)))
    if failed is not None:
        return _done(failed)
    if ev.exit_code == ["0"]:
        return Verdict("completed", "the job ended with exit code 0")
    if state.startswith("NEVER RAN"):  # the job folder's record, after Slurm forgot the job
        return Verdict("never ran", "the job never started: no start record in its job folder (cancelled while "
                       "pending, or the folder is not on a file system the compute nodes share)")
    if state.startswith("ENDED (killed") and status is None:
        return _done(Verdict("unknown", "the batch shell ended without recording an exit status (killed: SIGKILL "
                             "after a time limit or scancel, or its node was lost)", evidence=_tail(ev.combined)))
    if ev.exit_code == ["143"] and status is None:  # the batch shell's own record, after Slurm forgot the job
        return _done(Verdict("terminated", "the batch shell got SIGTERM (scancel, the time limit or a preemption; "
                             "Slurm no longer knows which)", evidence=_tail(ev.combined)))
    return _done(Verdict("unknown", f"Slurm state {base}, exit code {''.join(ev.exit_code) or '?'}",
                         evidence=_tail(ev.combined)))


def _silent(ev: Evidence) -> Verdict | None:
    """Ranks rank 0's watchdog found silent (``ranks_lost``) on nodes that still answer: a collective failure."""
    silent = ev.event("ranks_lost")
    if silent is None:
        return None
    ranks = [int(r) for r in silent.get("ranks") or []]
    hosts = ", ".join(map(str, silent.get("hosts") or [])) or "?"
    return Verdict("collective failure", f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                   f"({hosts}) stopped answering at step {silent.get('step')}: their heartbeats stopped (the process "
                   f"was gone or stuck holding the GIL)", ranks[0] if ranks else None,
                   hosts.split(", ")[0] if ranks else None, _tail(ev.combined, 3))


def _lost(folder: Path | None, ev: Evidence) -> Verdict | None:
    """A node of the step that did not answer the batch script's probe after the step failed (``lost``: one line
    per host, ``HOST RANKS``): the node failed, whatever its surviving peers printed while waiting for it."""
    rows = JobFiles(folder).step.lost() if folder else []
    if not rows:
        return None
    silent = ev.event("ranks_lost")
    step = silent.get("step") if silent is not None else last_step(folder)
    at = f" at step {step:,}" if isinstance(step, int) else ""
    parts = []
    for host, listed in rows:
        said = f"rank{'s' if len(listed) > 1 else ''} {', '.join(listed)}" if listed else "its ranks"
        parts.append(f"{host} ({said} stopped answering{at})")
    first = ev.exits[0] if ev.exits else None
    seen = [f"first failure seen: {first.where}, exit status {first.code}"] if first else []
    return Verdict("node failure", f"node lost: {'; '.join(parts)}", None, rows[0][0],
                   seen + [f"{host}: no answer to a trivial job step after the step failed" for host, _ in rows])


_STEP = re.compile(r"\| step (\d+)|^Graceful stop at epoch \d+, step (\d+)", re.MULTILINE)


def last_step(folder: Path | None) -> int | None:
    """The highest optimizer step the job reached: trainstack's own records (a graceful stop, a finished run, a
    resumed or first step) and rank 0's log (live lines, epoch lines, the graceful stop's line), or None."""
    if folder is None:
        return None
    steps = [int(e["step"]) for e in events.read(folder) if isinstance(e.get("step"), int)]
    furthest = JobFiles(folder).progress_step()  # rank 0's watchdog: the furthest step any rank reached
    if furthest is not None:
        steps.append(furthest)
    text = _read(folder / rank_log(0))
    steps += [int(m.group(1) or m.group(2)) for m in _STEP.finditer(text)]
    return max(steps) if steps else None


_ROOT_CAUSE = re.compile(r"^Root Cause \(first observed failure\):\n\[\d+\]:\n\s+time\s*:\s*(?P<time>\S+)\n"
                         r"\s+host\s*:.*\n\s+rank\s*:\s*(?P<rank>\d+).*\n\s+exitcode\s*:\s*(?P<code>-?\d+)",
                         re.MULTILINE)


def _torchrun_root_cause(ev: Evidence) -> tuple[int, int] | None:
    """The first worker failure torchrun's agents reported in this attempt ("Root Cause (first observed
    failure)"): (rank, its exit code, negative for a signal) -- what a node task's own status (the agent's 1)
    hides."""
    import datetime

    found = []
    for m in _ROOT_CAUSE.finditer(ev.combined):
        try:
            when = datetime.datetime.strptime(m.group("time"), "%Y-%m-%d_%H:%M:%S").timestamp()
        except ValueError:
            continue
        if when >= int(ev.since) - 1:
            found.append((when, int(m.group("rank")), int(m.group("code"))))
    return min(found)[1:] if found else None


def _ended_without_traceback(ev: Evidence, first: Exit) -> Verdict | None:
    """The verdict for the first failing task when it left no traceback: killed, crashed by a signal, or an error
    status of its own; None for the stop every task gets (SIGTERM, SIGINT, SIGHUP). A torchrun agent's task (its
    status 1 for any worker failure) is judged by the worker failure it reported."""
    lines = _last_lines(ev, first)
    cause = _torchrun_root_cause(ev) if first.rank is None else None
    if cause is not None and cause[1] < 0:  # a worker killed by a signal: judged as that rank's own end
        first = Exit(first.time, 128 - cause[1], rank_unit(cause[0]), first.host)
    if first.code == 137:
        return Verdict("killed (signal 9)", f"a process was killed with signal 9 ({first.where}): the kernel's OOM "
                       f"killer, Slurm's memory limit or a kill -9", first.rank, first.host,
                       _matching(ev.combined, _SIGKILL) or lines)
    if first.code - 128 in _SIGNALS:
        name = _SIGNALS[first.code - 128]
        return Verdict("crashed (signal)", f"{first.where} crashed with signal {first.code - 128} ({name}) first",
                       first.rank, first.host, lines)
    if first.code in (143, 130, 129):
        return None
    said = f"; its last line: {lines[-1][:200]}" if lines else ""
    return Verdict("exited", f"{first.where} exited with status {first.code} first, without a traceback{said}",
                   first.rank, first.host, lines)


def _first_failure(ev: Evidence, folder: Path | None) -> Verdict | None:
    """The rank whose traceback is a primary error (not a collective or kill cascade): the first to fail when the
    exit records say, else the lowest."""
    errors: dict[int | None, tuple[str, str, str]] = {}
    for r, text in ev.texts.items():
        found = _last_error(text)
        if found is not None:
            errors[r] = found
    if not errors and ev.combined:
        found = _last_error(ev.combined)
        if found is not None:
            errors[_rank_named(ev.combined)] = found
    primary = {r: e for r, e in errors.items() if not _is_collective(e[0], e[1])}
    chosen = primary or errors
    if not chosen:
        return None
    ranks = [r for r in chosen if r is not None]
    order = [x.rank for x in ev.exits if x.rank in chosen]
    rank = order[0] if order else (min(ranks) if ranks else None)
    kind_line, message, frame = chosen[rank]
    host = _host(ev, rank, folder)
    where = f" on rank {rank}" + (f" ({host})" if host else "") if rank is not None else ""
    text = f"{kind_line}{': ' + message if message else ''}"
    if kind_line.split(".")[-1] == "StaleLease":
        return Verdict("superseded", f"{message[:400]}{where}", rank, host, [text[:300], frame])
    transport = _transport_failure(ev, folder, kind_line, message)
    if transport is not None:
        return Verdict("nccl transport", f"{transport[:400]}{where}", rank, host, [text[:300], frame])
    if _CUDA_OOM.search(kind_line) or _CUDA_OOM.search(message):
        return Verdict("cuda out-of-memory", f"CUDA out of memory{where}", rank, host, [text, frame])
    if _CUDA_FAULT.search(message):
        return Verdict("cuda error", f"{text[:200]}{where} (a GPU or driver fault: the host is suspect)", rank, host,
                       [text, frame])
    if not primary:
        return _stopped_first(ev, kind_line, where, rank, host, [text, frame], folder)
    others = sorted(r for r in errors if r != rank and r is not None)
    cascade = f"; ranks {', '.join(map(str, others))} failed after it" if others else ""
    return Verdict("python error", f"{text[:200]}{where} at {frame}{cascade}", rank, host, [text, frame])


def _transport_failure(ev: Evidence, folder: Path | None, kind_line: str, message: str) -> str | None:
    """A required NCCL transport that was missing: trainstack's own check said so (TransportError), or NCCL failed
    on the NCCL_NET it was given -- the reason then comes from NCCL's init lines in the log folder."""
    if kind_line.split(".")[-1] == "TransportError":
        return message
    said = "\n".join([message, ev.combined, *ev.texts.values()])
    found = _NCCL_NOT_FOUND.search(said)
    required = _transport.by_network(found["net"]) if found else None
    if required is None:
        return None
    files = [p for p in folder.glob("nccl.*.log") if _newer(p, ev.since)] if folder is not None else []
    owner = JobFiles(folder).uid if folder is not None else None  # this job's own files, in its folder only
    return _transport.judge(required.name, _transport.read_init_files(files, extra=said, owner=owner))


def _is_collective(kind_line: str, message: str) -> bool:
    """A failure of torch.distributed itself (the cascade after another rank stopped), by exception type, or by the
    gloo/NCCL messages torch raises as RuntimeError -- never a program's own BrokenPipeError."""
    return bool(_COLLECTIVE_TYPE.search(kind_line)) or (kind_line.split(".")[-1] == "RuntimeError"
                                                        and bool(_COLLECTIVE.search(message)))


def _host(ev: Evidence, rank: int | None, folder: Path | None) -> str | None:
    """The host of ``rank``: its exit record, else a host the rank's log names."""
    for x in ev.exits:
        if rank is not None and x.rank == rank:
            return x.host
    return _host_of(ev.texts.get(rank, "") if rank is not None else ev.combined)


def _last_lines(ev: Evidence, first: Exit, n: int = 3) -> list[str]:
    """The last lines of the failing task's own log (the combined log when it has none)."""
    text = ev.texts.get(first.rank, "") if first.rank is not None else ""
    return _tail(text or ev.combined, n)


def _graceful(ev: Evidence) -> str | None:
    """This attempt's graceful stop, from trainstack's own record (without a job folder: its own line, at the start
    of a line of the log)."""
    found = ev.event("graceful_stop")
    if found is not None:
        return str(found.get("line") or f"Graceful stop at step {found.get('step')}")
    if ev.texts or ev.events:  # a trainstack job folder: its records decide, not a printed line
        return None
    lines = [m.group(0) for m in _GRACEFUL.finditer(ev.combined)]
    return lines[-1] if lines else None


def attempt_start(folder: Path | None) -> float:
    """When the current attempt started (the last line of the job folder's ``started``), 0 when unknown."""
    return JobFiles(folder).attempt_start() if folder is not None else 0.0


def exit_records(folder: Path | None) -> list[Exit]:
    """The failing tasks of the current step, first first."""
    return JobFiles(folder).step.exits() if folder is not None and folder.is_dir() else []


def _srun_exits(combined: str) -> list[Exit]:
    """srun's own lines, in the order it printed them (jobs from before the exit records)."""
    out = []
    for i, m in enumerate(_SRUN_EXIT.finditer(combined)):
        code = 137 if m.group("killed") else int(m.group("code"))
        out.append(Exit(float(i), code, rank_unit(m.group('task')), m.group("host")))
    return out


def _down_nodes() -> list[str]:
    """Nodes Slurm has down, drained or not responding now (with their reason), best effort."""
    import subprocess

    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-t", "down,drain,fail,no_respond", "-o", "%N"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(set(out.split()))


def _stopped_early(combined: str) -> Verdict | None:
    """A job that ended cleanly after a graceful stop it was not requeued from (no --requeue): the training is not
    done, only the attempt."""
    m = _NOT_REQUEUED.search(combined[max(combined.rfind("trainstack: finished (restart count"), 0):])
    if m is None:
        return None
    kind = "preempted" if m.group(1) == "preempt" else "time limit"
    return _done(Verdict(kind, f"stopped gracefully with a checkpoint ({m.group(1)}) and not requeued (no "
                               f"--requeue): resume='auto' continues it", evidence=[m.group(0)]))


def _stopped_first(ev: Evidence, kind_line: str, where: str, rank: int | None, host: str | None,
                   evidence: list[str], folder: Path | None) -> Verdict:
    """A collective failure: every rank that failed, failed waiting on the others. A rank with a log but no error
    of its own is the one that stopped answering (stuck, or killed without a trace): it is the suspect."""
    texts = ev.texts
    silent = sorted(r for r, text in texts.items() if _last_error(text) is None)
    if silent and len(silent) < len(texts):
        suspect = silent[0]
        shost = _host(ev, suspect, folder) or None
        at = f" ({shost})" if shost else ""
        others = ", ".join(str(r) for r in sorted(texts) if r not in silent)
        return Verdict("collective failure", f"rank {suspect}{at} stopped answering a collective; ranks {others} "
                       f"failed waiting for it ({kind_line})", suspect, shost, evidence)
    return Verdict("collective failure", f"{kind_line}{where} (no rank failed first in its own code)", rank, host,
                   evidence)


def _last_error(text: str) -> tuple[str, str, str] | None:
    """(exception type, message, innermost user frame) of the last traceback in ``text``."""
    lines = [_PREFIX.sub("", line) for line in text.splitlines()]  # torch prefixes a rank's errors: "[rank1]: "
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    block = lines[starts[-1]:]
    frames = [m for m in (_FRAME.match(line) for line in block) if m]
    user = [m for m in frames if "/site-packages/" not in m.group("file") and "/trainstack/" not in m.group("file")
            and not m.group("file").startswith("<")]
    picks = user or frames
    frame = f"{Path(picks[-1].group('file')).name}:{picks[-1].group('line')} ({picks[-1].group('fn')})" \
        if picks else "?"
    for line in block[1:]:
        m = _TRACE_END.match(line.strip())
        if m and not line.startswith(" "):
            return m.group("type"), (m.group("msg") or "").strip(), frame
    return None


def _rank_texts(folder: Path | None) -> dict[int, str]:
    if folder is None or not folder.is_dir():
        return {}
    out = {}
    for path in folder.glob(rank_log("*")):
        m = _RANK_LOG.search(path.name)
        if m:
            text = _read(path)
            at = text.rfind(ATTEMPT_MARK)
            out[int(m.group(1))] = text[text.find("\n", at) + 1:] if at >= 0 else text
    return out


def _rank_named(text: str) -> int | None:
    m = re.search(r"worker rank (\d+) failed|rank (\d+)", text)
    return int(next(g for g in m.groups() if g is not None)) if m else None


def _host_of(text: str) -> str | None:
    m = re.search(r"\(([\w.-]+), pid \d+\)|\bhost[= ]([\w.-]+)", text)
    return next((g for g in m.groups() if g), None) if m else None


def _hang(ev: Evidence, folder: Path | None) -> list[str] | None:
    """This attempt's hang: the watchdog's event, else a ``SUMMARY.txt`` newer than the attempt's start in the run
    folder the job names or in the job folder (not its code snapshot); without a job folder, the report the watchdog
    printed at the start of a line of the log."""
    found = ev.event("hang")
    if found is not None:
        return [*(found.get("behind") or [])[:3], str(found.get("reason") or "hang report"),
                f"report: {found.get('folder')}"]
    if folder is not None:  # a trainstack job: the watchdog's own records, never a printed line
        return _hang_summary(folder, ev.since)
    return _hang_in_logs([ev.combined])


def _hang_summary(folder: Path | None, since: float) -> list[str] | None:
    if folder is None or not folder.is_dir():
        return None
    roots = [folder]
    named = JobFiles(folder).run_folder()
    if named and Path(named).is_dir():
        roots.append(Path(named))
    summaries = sorted((p for root in roots for p in root.glob("*hang-*/SUMMARY.txt") if _newer(p, since)),
                       key=lambda p: p.stat().st_mtime)
    summaries += sorted(p for p in folder.glob("*/hang-*/SUMMARY.txt")
                        if p.parts[len(folder.parts)] != "code" and _newer(p, since) and p not in summaries)
    if not summaries:
        return None
    lines = [line for line in _read(summaries[-1]).splitlines() if line.strip()]
    behind = [line for line in lines if "behind" in line or "sent no report" in line]
    return (behind or lines[:1]) + [f"report: {summaries[-1].parent}"]


def _newer(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def _hang_in_logs(texts: list[str]) -> list[str] | None:
    """The watchdog's printed report (its SUMMARY.txt lives in the run folder, which may be anywhere), at the
    start of a line, as only the watchdog prints it."""
    for text in texts:
        lines = [_PREFIX.sub("", line) for line in text.splitlines()]
        starts = [i for i, line in enumerate(lines) if line.startswith(_HANG_LINE)]
        if starts:
            block = lines[starts[-1]:starts[-1] + 60]
            behind = [line for line in block if "behind" in line or "sent no report" in line]
            return behind[:3] + [block[0][:300]]
    return None


def _matching(text: str, pattern: re.Pattern[str]) -> list[str]:
    return [line for line in text.splitlines() if pattern.search(line)][-3:]


def _tail(text: str, n: int = 5) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


def _read(path: Path | None) -> str:
    """A log's newest 200 kB, read as data (``read_back``: never a FIFO, a link or an unbounded read)."""
    return read_back_text(path, 200_000, owner=None, tail=True, quiet=True) if path is not None else ""


def _done(v: Verdict) -> Verdict:
    v.hints = list(_HINTS.get(v.kind, []))
    return v
