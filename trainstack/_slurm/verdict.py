"""Why did a job end? A verdict from what the job already left behind -- Slurm's state, the job folder's
``exit_code``/``cancelled``, the per-rank logs, the hang watchdog's ``SUMMARY.txt`` -- at no cost to the run.

The first failing rank is the one with a *primary* error: after one rank fails, the others die of collective
errors (connection closed, timeouts) or of the launcher's kill; those are evidence of the cascade, not the cause.
Torch-free.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Verdict", "verdict", "KINDS", "HOST_FAULTS"]

KINDS = ("completed", "cancelled", "preempted", "time limit", "hang", "cuda out-of-memory", "cuda error",
         "killed (signal 9)", "collective failure", "node failure", "python error", "running", "unknown")
#: Verdicts that blame the machine, not the program: a requeue leaves the host out.
HOST_FAULTS = ("cuda error", "node failure")

_TRACE_END = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Error\w*))(?::\s*(?P<msg>.*))?$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')
_COLLECTIVE = re.compile(r"Connection closed by peer|Connection reset by peer|ProcessGroupGloo|ProcessGroupNCCL|"
                         r"Watchdog caught collective operation timeout|NCCL error|gloo.*(timeout|Timed out)|"
                         r"DistBackendError|DistNetworkError|Broken pipe", re.IGNORECASE)
_CUDA_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory", re.IGNORECASE)
_CUDA_FAULT = re.compile(r"CUDA error|illegal memory access|uncorrectable ECC|unhandled cuda error|Xid", re.IGNORECASE)
_SIGKILL = re.compile(r"killed by SIGKILL|Killed$|oom-kill|signal 9|exit code 137|OUT_OF_MEMORY", re.IGNORECASE)
_GRACEFUL = re.compile(r"Graceful stop at epoch \d+, step \d+|Interrupted at epoch \d+, step \d+")
_NOT_REQUEUED = re.compile(r"stopped gracefully with a complete checkpoint \((\w+)\); not requeued")
_RANK_LOG = re.compile(r"rank-(\d+)\.out$")
_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_KILLED_TASK = re.compile(r"srun: error: (?P<host>\S+): task (?P<task>\d+): (?:Exited with exit code 137|Killed)")
_HINTS = {
    "cuda out-of-memory": ["a smaller per-process batch with more gradient_accumulation_steps",
                           "mixed_precision='bf16'", "strategy='fsdp' to shard parameters and optimizer state"],
    "killed (signal 9)": ["host memory: fewer DataLoader workers, a smaller in-memory dataset, or --mem",
                          "`sacct -j JOB -o MaxRSS` (where accounting works) shows the peak"],
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
    "preempted": ["with --requeue the job continues from its checkpoint"],
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


def verdict(state: str, folder: Path | None, log: Path | None, status: int | None = None) -> Verdict:
    """The verdict for a job in Slurm ``state`` with its job folder and combined log (either may be missing);
    ``status``: the launch's exit status when the caller knows it (the batch script, right after an attempt)."""
    base = state.split(" (")[0].split()[0] if state else "UNKNOWN"
    if base in ("RUNNING", "PENDING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED"):
        return Verdict("running", f"the job is {base.lower()}")
    texts = _rank_texts(folder)
    combined = _read(log)
    exit_code = [str(status)] if status is not None else \
        (_read(folder / "exit_code").strip().splitlines()[-1:] if folder else [])
    if base == "COMPLETED":  # a requeued job's log also holds the failures of its earlier attempts
        return _stopped_early(combined) or Verdict("completed", "the job ended with exit code 0")
    hang = _hang_summary(folder) or _hang_in_logs([combined, *texts.values()])
    if hang is not None:
        return _done(Verdict("hang", hang[0], evidence=hang))
    if (folder is not None and (folder / "cancelled").exists()) or base == "CANCELLED":
        return _done(Verdict("cancelled", "cancelled by the user (trainstack cancel / scancel)"))
    if base == "NODE_FAIL":
        down = _down_nodes()
        now = f" (down now: {', '.join(down)})" if down else ""
        return _done(Verdict("node failure", f"Slurm marked a node of the job as failed{now}",
                             host=down[0] if len(down) == 1 else None, evidence=_tail(combined)))
    graceful = [m.group(0) for m in _GRACEFUL.finditer(combined)]
    if base == "TIMEOUT":
        done = f"after a graceful stop ({graceful[-1]})" if graceful else "without a graceful stop (no checkpoint " \
            "was written at the limit)"
        return _done(Verdict("time limit", f"the time limit was reached {done}", evidence=_tail(combined)))
    if base == "PREEMPTED" or (graceful and "Interrupted" not in graceful[-1] and base != "COMPLETED"):
        return _done(Verdict("preempted", graceful[-1] if graceful else "preempted by Slurm"))
    failed = _first_failure(texts, combined)
    if failed is not None and failed.kind != "collective failure":
        return _done(failed)
    # a killed rank leaves no traceback, only a cascade
    if base == "OUT_OF_MEMORY" or _SIGKILL.search(combined) or exit_code == ["137"]:
        killed = _KILLED_TASK.search(combined)
        rank, host = (int(killed.group("task")), killed.group("host")) if killed else (None, None)
        where = f" (rank {rank} on {host})" if killed else ""
        return _done(Verdict("killed (signal 9)", f"a process was killed with signal 9{where}: the kernel's OOM "
                             f"killer, Slurm's memory limit or a kill -9", rank, host, _matching(combined, _SIGKILL)))
    if failed is not None:
        return _done(failed)
    if exit_code == ["0"]:
        return Verdict("completed", "the job ended with exit code 0")
    if state.startswith("NEVER RAN"):  # the job folder's record, after Slurm forgot the job
        return Verdict("never ran", "the job never started: no start record in its job folder (cancelled while "
                       "pending, or the folder is not on a file system the compute nodes share)")
    if state.startswith("ENDED (killed") and status is None:
        return _done(Verdict("unknown", "the batch shell ended without recording an exit status (killed: SIGKILL "
                             "after a time limit or scancel, or its node was lost)", evidence=_tail(combined)))
    if exit_code == ["143"] and status is None:  # the batch shell's own record, after Slurm forgot the job
        return _done(Verdict("terminated", "the batch shell got SIGTERM (scancel, the time limit or a preemption; "
                             "Slurm no longer knows which)", evidence=_tail(combined)))
    return _done(Verdict("unknown", f"Slurm state {base}, exit code {''.join(exit_code) or '?'}",
                         evidence=_tail(combined)))


def _first_failure(texts: dict[int, str], combined: str) -> Verdict | None:
    """The rank whose traceback is a primary error (not a collective or kill cascade), lowest rank first."""
    errors: dict[int | None, tuple[str, str, str]] = {}
    for r, text in texts.items():
        found = _last_error(text)
        if found is not None:
            errors[r] = found
    if not errors and combined:
        found = _last_error(combined)
        if found is not None:
            errors[_rank_named(combined)] = found
    primary = {r: e for r, e in errors.items() if not _COLLECTIVE.search(e[0] + " " + e[1])}
    chosen = primary or errors
    if not chosen:
        return None
    ranks = [r for r in chosen if r is not None]
    rank = min(ranks) if ranks else None
    kind_line, message, frame = chosen[rank]
    host = _host_of(texts.get(rank, "") if rank is not None else combined)
    where = f" on rank {rank}" + (f" ({host})" if host else "") if rank is not None else ""
    text = f"{kind_line}{': ' + message if message else ''}"
    if _CUDA_OOM.search(text):
        return Verdict("cuda out-of-memory", f"CUDA out of memory{where}", rank, host, [text, frame])
    if _CUDA_FAULT.search(text):
        return Verdict("cuda error", f"{text[:200]}{where} (a GPU or driver fault: the host is suspect)", rank, host,
                       [text, frame])
    if not primary:
        return _stopped_first(texts, kind_line, where, rank, host, [text, frame])
    others = sorted(r for r in errors if r != rank and r is not None)
    cascade = f"; ranks {', '.join(map(str, others))} failed after it" if others else ""
    return Verdict("python error", f"{text[:200]}{where} at {frame}{cascade}", rank, host, [text, frame])


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


def _stopped_first(texts: dict[int, str], kind_line: str, where: str, rank: int | None, host: str | None,
                   evidence: list[str]) -> Verdict:
    """A collective failure: every rank that failed, failed waiting on the others. A rank with a log but no error
    of its own is the one that stopped answering (stuck, or killed without a trace): it is the suspect."""
    silent = sorted(r for r, text in texts.items() if _last_error(text) is None)
    if silent and len(silent) < len(texts):
        suspect = silent[0]
        shost = _host_of(texts[suspect]) or None
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
    for path in folder.glob("rank-*.out"):
        m = _RANK_LOG.search(path.name)
        if m:
            out[int(m.group(1))] = _read(path)
    return out


def _rank_named(text: str) -> int | None:
    m = re.search(r"worker rank (\d+) failed|rank (\d+)", text)
    return int(next(g for g in m.groups() if g is not None)) if m else None


def _host_of(text: str) -> str | None:
    m = re.search(r"\bon (node[\w-]*|[\w-]+\.[\w.-]+)\b|host[= ](\S+)", text)
    return next((g for g in m.groups() if g), None) if m else None


def _hang_summary(folder: Path | None) -> list[str] | None:
    if folder is None:
        return None
    summaries = sorted(folder.rglob("hang-*/SUMMARY.txt"))
    if not summaries:
        return None
    lines = [line for line in _read(summaries[-1]).splitlines() if line.strip()]
    behind = [line for line in lines if "behind" in line or "sent no report" in line]
    return (behind or lines[:1]) + [f"report: {summaries[-1].parent}"]


def _hang_in_logs(texts: list[str]) -> list[str] | None:
    """The watchdog's printed report (its SUMMARY.txt lives in the run folder, which may be anywhere)."""
    for text in texts:
        at = text.rfind("trainstack hang report")
        if at >= 0:
            block = [_PREFIX.sub("", line) for line in text[at:].splitlines()[:60]]
            behind = [line for line in block if "behind" in line or "sent no report" in line]
            return behind[:3] + [block[0][:300]]
    return None


def _matching(text: str, pattern: re.Pattern[str]) -> list[str]:
    return [line for line in text.splitlines() if pattern.search(line)][-3:]


def _tail(text: str, n: int = 5) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


def _read(path: Path | None) -> str:
    try:
        return path.read_text(errors="replace")[-200_000:] if path is not None else ""
    except OSError:
        return ""


def _done(v: Verdict) -> Verdict:
    v.hints = list(_HINTS.get(v.kind, []))
    return v
