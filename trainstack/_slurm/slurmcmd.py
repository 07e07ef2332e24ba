"""Every Slurm command a job runs on its own allocation, in one place: what an admin reads to see what a trainstack
job does to Slurm, and the one object a test replaces (``tests/test_allocation.py``).

The driver (``allocation.py``) asks ``Slurm`` for the allocation's hosts, the time left, the submission time; it
launches job steps and one-task probes with ``srun`` (``--overlap``: beside the remains of a failed step), kills a
failed step's tasks, and requeues the job (``scontrol requeue``, ``update ExcNodeList``, ``update StartTime=now``).
Every call is bounded in time and never raises for Slurm's own failures: the answer says what happened.
Torch-free.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Slurm", "Requeued", "slurm_seconds", "parse_node_states", "TRANSIENT"]

#: Slurm's answers that mean "not now" rather than "no": a busy or restarting controller, or a job whose failed node
#: was just taken out of it (its update waits for a database index). A requeue's calls are tried again on these.
TRANSIENT = ("try again", "timed out", "Unable to contact", "temporarily unavailable", "not available right now",
             "Zero Bytes were transmitted")
#: How long a requeue's calls are tried again (the requeue itself; leaving hosts out; releasing the hold).
RETRY_S = (30.0, 8.0, 8.0)
#: How long a hand-back of lost hosts is tried again (a job whose node just failed waits for its database index).
RELEASE_S = 20.0
RETRY_PAUSE_S = 1.0


@dataclass(frozen=True)
class Requeued:
    """What ``Slurm.requeue`` did: ``done`` (Slurm took it, or a requeue was already pending: ``already``), Slurm's
    ``answer`` to it, and whether the hosts were left out and Slurm's hold released (``released``: the job starts as
    soon as nodes are free; else after Slurm's own delay, about two minutes)."""

    done: bool
    answer: str = ""
    already: bool = False
    excluded: bool = False
    released: bool = False
    hold_answer: str = ""

    @property
    def hold(self) -> str:
        """The log's line about Slurm's hold on the requeued job."""
        if self.released:
            return "asked Slurm to start the requeued job without its hold (trainstack submit --wait releases a hold " \
                   "set later)"
        return f"Slurm keeps its hold on the requeued job ({self.hold_answer or 'no answer'}): it starts after " \
               f"Slurm's own delay, about two minutes"


def slurm_seconds(text: str) -> int | None:
    """A Slurm time (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``, ``UNLIMITED``) in seconds (None:
    unlimited). The one parser of Slurm's times: ``--time`` and ``squeue``'s time left."""
    text = text.strip()
    if text in ("UNLIMITED", "INFINITE", "NOT_SET", "INVALID", ""):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, sec = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


#: sinfo's states of a node the scheduler can give a job; a ``*`` suffix (not responding) takes it out of service,
#: power-saving suffixes (``~`` off, ``#`` powering up) do not: Slurm starts such a node for the job.
_SERVING = ("idle", "mix", "alloc", "comp", "plnd")


def parse_node_states(text: str) -> dict[str, bool]:
    """``sinfo -h -N -o "%N %t"`` lines as {host: in service?} (a node listed in several partitions once)."""
    nodes: dict[str, bool] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            state = parts[1]
            serving = not state.endswith("*") and state.rstrip("~#!%$@^-") in _SERVING
            nodes[parts[0]] = nodes.get(parts[0], False) or serving
    return nodes


class Slurm:
    """The Slurm commands of one job (``job_id``), run from its batch host."""

    def __init__(self, job_id: str, env: Mapping[str, str] | None = None) -> None:
        self.job_id = job_id
        self.env = dict(os.environ if env is None else env)

    def _run(self, argv: Sequence[str], timeout: float = 30, cwd: Path | None = None) -> tuple[int, str]:
        try:
            out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=self.env,
                                 stdin=subprocess.DEVNULL, cwd=cwd)
        except (OSError, subprocess.SubprocessError) as exc:
            return 127, str(exc)
        return out.returncode, (out.stdout + out.stderr).strip()

    # ------------------------------------------------------------------ what the job holds
    def hostnames(self, nodelist: str) -> list[str]:
        """A Slurm node list (``node[1-3]``) as host names, in order."""
        if not nodelist:
            return []
        code, out = self._run(["scontrol", "show", "hostnames", nodelist])
        return out.split() if code == 0 else []

    def release(self, keep: Sequence[str], folder: Path) -> tuple[bool, str]:
        """Shrink the running job to the hosts ``keep`` (``scontrol update JobId=... NodeList=...``): the others --
        lost nodes the job no longer uses -- are handed back, so the job's end does not wait for Slurm to declare
        them dead (SlurmdTimeout, 300 s by default). scontrol writes its environment-reset scripts
        (``slurm_job_<id>_resize.sh``) where it runs: in ``folder`` (the job folder), never the user's working
        directory. (done, Slurm's answer)."""
        argv = ["scontrol", "update", f"JobId={self.job_id}", f"NodeList={','.join(keep)}"]
        deadline = time.monotonic() + RELEASE_S
        while True:
            code, out = self._run(argv, cwd=folder if folder.is_dir() else None)
            if code == 0:
                return True, out
            held = self.held()
            if held is not None and not set(held) - set(keep):  # Slurm took them out itself (declared them dead)
                return True, "already taken out by Slurm"
            if not any(t in out for t in TRANSIENT) or time.monotonic() >= deadline:
                return False, out
            time.sleep(RETRY_PAUSE_S)

    def held(self) -> list[str] | None:
        """The hosts the running job holds now (``squeue %N``); None when Slurm cannot say."""
        code, out = self._run(["squeue", "-h", "-j", self.job_id, "-o", "%N"])
        return self.hostnames(out.splitlines()[0].strip()) if code == 0 and out.strip() else None

    def seconds_left(self) -> int | None:
        """The job's time left (``squeue %L``); None when unlimited or unknown."""
        code, out = self._run(["squeue", "-h", "-j", self.job_id, "-o", "%L"])
        try:
            return slurm_seconds(out.splitlines()[0]) if code == 0 and out else None
        except ValueError:
            return None

    def submitted(self) -> float:
        """When the job was submitted (``squeue %V``), as a Unix time; 0 when unknown."""
        import datetime

        code, out = self._run(["squeue", "-h", "-j", self.job_id, "-o", "%V"])
        try:
            return datetime.datetime.fromisoformat(out.splitlines()[0].strip()).timestamp() if code == 0 else 0.0
        except (ValueError, IndexError):
            return 0.0

    def log_path(self) -> Path | None:
        """The job's own log (``StdOut`` of ``scontrol show job``), where its batch script's output goes."""
        code, out = self._run(["scontrol", "show", "job", "-o", self.job_id])
        found = [w.split("=", 1)[1] for w in out.split() if w.startswith("StdOut=")] if code == 0 else []
        return Path(found[0]) if found else None

    def partition_nodes(self) -> dict[str, bool]:
        """{host: in service?} for the job's partition (``sinfo``): down, drained, failing or not responding nodes
        are not; empty where sinfo cannot be asked."""
        partition = self.env.get("SLURM_JOB_PARTITION")
        code, out = self._run(["sinfo", "-h", "-N", "-o", "%N %t", *(["-p", partition] if partition else [])])
        return parse_node_states(out) if code == 0 else {}

    # ------------------------------------------------------------------ job steps
    def launch(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path | None = None,
               output: Path | None = None) -> subprocess.Popen[bytes]:
        """A job step (``srun ...``) in the background; its output to the job's log (or ``output``)."""
        out = open(output, "ab") if output is not None else None  # noqa: SIM115 -- the step owns it
        try:
            return subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT if out is not None else None)
        finally:
            if out is not None:
                out.close()

    def on_nodes(self, hosts: Sequence[str], argv: Sequence[str], timeout: float, output: Path | None = None,
                 env: Mapping[str, str] | None = None) -> int:
        """One task per host (``srun --overlap``), beside a running step; killed at ``timeout``."""
        words = ["srun", "--overlap", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
                 f"--nodelist={','.join(hosts)}", *argv]
        proc = self.launch(words, env or self.env, output=output)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                return proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()

    def answering(self, hosts: Sequence[str], timeout: float = 5,
                  into: dict[str, bool] | None = None) -> dict[str, bool]:
        """{host: answers a trivial one-task step?}, all hosts asked at once: within ``timeout``, and within
        ``ANSWER_SETTLE_S`` (or 3x the first answer's time) of the first host that answered -- a live slurmd
        answers a trivial step in well under a second, as its peers show, so a lost node costs seconds less.
        ``into``: filled as the answers come (a watcher reads them before the last one)."""
        return self.each(hosts, ["true"], timeout, settle_s=ANSWER_SETTLE_S, into=into)

    def each(self, hosts: Sequence[str], argv: Sequence[str], timeout: float,
             settle_s: float | None = None, into: dict[str, bool] | None = None) -> dict[str, bool]:
        """``argv`` as a one-task step on every host at once (``srun --overlap``): {host: it succeeded in time?} (a
        host that does not answer is killed; ``settle_s`` and ``into``: see ``wait_answers``)."""
        probes = {h: self.launch(["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={h}", *argv],
                                 self.env, output=Path(os.devnull)) for h in hosts}
        return wait_answers(probes, timeout, settle_s, into)

    def kill_steps(self, keep: str | Collection[str] = ()) -> None:
        """SIGKILL to every job step of this job still known to Slurm but those named in ``keep`` (the sentinel's,
        the idle standbys'), without waiting for the answer (a lost node keeps ``scancel`` waiting for Slurm's
        MessageTimeout)."""
        kept = {keep} if isinstance(keep, str) else set(keep)
        code, out = self._run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"])
        for line in out.splitlines() if code == 0 else []:
            step, _, name = line.partition(" ")
            if step.startswith(f"{self.job_id}.") and step.rsplit(".", 1)[1].isdigit() and name.strip() not in kept:
                subprocess.Popen(["scancel", "--signal=KILL", step], env=self.env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def end(self, job: str) -> None:
        """End the job (``scancel``): what its driver does where no batch script is left to end it."""
        self._run(["scancel", job], timeout=60)

    # ------------------------------------------------------------------ requeue
    def requeue(self, job: str, leave_out: Sequence[str] = (), nodes: str = "") -> Requeued:
        """``scontrol requeue JOB`` (an array task by ``<array>_<task>``), then ``update ExcNodeList`` with
        ``leave_out``, ``NumNodes`` with ``nodes`` where given (MIN-MAX) and ``StartTime=now`` (Slurm holds a
        requeued job; its owner may release it). A transient
        answer is asked again (``TRANSIENT``); the caller ignores SIGTERM meanwhile (the requeue signals it too)."""
        code, answer = self._retrying(["scontrol", "requeue", job], RETRY_S[0])
        already = code != 0 and "pending execution" in answer  # a user's own scontrol requeue got there first
        if code != 0 and not already:
            return Requeued(False, answer)
        excluded = bool(leave_out) and self._retrying(
            ["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(leave_out)}"], RETRY_S[1])[0] == 0
        if nodes:  # --min-nodes: the requeued job may start on fewer nodes than it asked for (MIN-MAX)
            self._retrying(["scontrol", "update", f"JobId={job}", f"NumNodes={nodes}"], RETRY_S[1])
        code, hold = self._retrying(["scontrol", "update", f"JobId={job}", "StartTime=now"], RETRY_S[2])
        return Requeued(True, answer, already, excluded, code == 0, hold)

    def _retrying(self, argv: Sequence[str], within_s: float) -> tuple[int, str]:
        """``_run`` again while Slurm's answer is transient, for up to ``within_s``."""
        deadline = time.monotonic() + within_s
        while True:
            code, out = self._run(argv)
            if code == 0 or not any(t in out for t in TRANSIENT) or time.monotonic() >= deadline:
                return code, out
            time.sleep(RETRY_PAUSE_S)


#: How long the hosts of a failed step that have not answered the probe get after the first one that did.
ANSWER_SETTLE_S = 1.5


def wait_answers(procs: Mapping[str, subprocess.Popen[bytes]], timeout: float,
                 settle_s: float | None = None, into: dict[str, bool] | None = None) -> dict[str, bool]:
    """{name: its process exited 0 in time?}: all waited for at once until ``timeout``; with ``settle_s``, the
    slow ones only until max(``settle_s``, 3x the first exit's time) after the first exit. Late ones are killed.
    ``into`` (where given) holds each answer as soon as it is known."""
    start = time.monotonic()
    deadline, answers = start + timeout, into if into is not None else {}
    while len(answers) < len(procs) and time.monotonic() < deadline:
        for name, proc in procs.items():
            if name not in answers and proc.poll() is not None:
                answers[name] = proc.returncode == 0
                if settle_s is not None and len(answers) == 1:
                    first = time.monotonic() - start
                    deadline = min(deadline, start + first + max(settle_s, 3 * first))
        time.sleep(0.02)
    for name, proc in procs.items():
        if name not in answers:
            proc.kill()
            proc.wait()
            answers[name] = False
    return {name: answers[name] for name in procs}
