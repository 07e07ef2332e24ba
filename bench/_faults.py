"""Faults on the local Slurm cluster (`make slurm-up`: node1-3 on one host), by pid: a rank killed, a node lost
(every process of its job step and its slurmd), and the node brought back. Shared by bench/recovery.py and
tests/slurm/test_recovery.py; the training program leaves ``pids/<host>-<rank>`` files in its output folder."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def rank_pids(out: Path, host: str) -> list[int]:
    """The training processes on ``host`` (their pid files, by rank)."""
    return [int(p.read_text().split()[0]) for p in sorted((out / "pids").glob(f"{host}-*"))]


def _up_to_stepd(pid: int) -> list[int]:
    """``pid`` and its parents up to and including the slurmstepd that runs it (the step's processes on a node)."""
    chain = []
    while pid > 1:
        chain.append(pid)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        if cmd.startswith("slurmstepd"):
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return chain


def kill_rank(out: Path, host: str, index: int) -> float:
    """SIGKILL the ``index``-th rank on ``host``; the time of the kill."""
    when = time.time()
    os.kill(rank_pids(out, host)[index], signal.SIGKILL)
    return when


def kill_node(out: Path, host: str, conf: Path) -> float:
    """A node lost: every process of the step on ``host`` (its ranks, their launcher and task wrapper, the
    slurmstepd, and whatever they started) and the node's slurmd, SIGKILL. The time of the kill."""
    slurmd = int((conf.parent / f"slurmd-{host}.pid").read_text().strip())
    return _lose(lambda: [slurmd, *_descendants(_step_daemons(out, host))])


def restore_nodes(env: dict[str, str], nodes: tuple[str, ...] = ("node1", "node2", "node3"),
                  timeout: float = 120) -> list[str]:
    """Start a killed slurmd again and resume its node; the nodes still not usable after ``timeout``."""
    conf = Path(env["SLURM_CONF"])
    for node in nodes:
        if subprocess.run(["pgrep", "-f", f"slurmd -f {conf} -N {node}"], capture_output=True).returncode != 0:
            subprocess.run(["slurmd", "-f", str(conf), "-N", node], check=False, timeout=30)
    deadline, down = time.monotonic() + timeout, list(nodes)
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"], env=env,
                                capture_output=True, text=True).stdout.split("\n")
        down = [line.split()[0] for line in states if line.strip() and line.split()[1].rstrip("*") not in
                ("idle", "mix", "alloc")]
        if not down:
            break
        for line in states:  # a down or drained node is resumed; one still completing its job is waited for
            if line.strip() and line.split()[1].rstrip("*~#") in ("down", "drain", "drng", "fail"):
                subprocess.run(["scontrol", "update", f"NodeName={line.split()[0]}", "State=RESUME"], env=env,
                               check=False, capture_output=True)
        time.sleep(1)
    return down


def _descendants(roots: list[int]) -> list[int]:
    """Every process below ``roots`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def kill_batch_host(out: Path, job_id: str, host: str, conf: Path) -> float:
    """The batch host lost: the job's batch step (its slurmstepd, the driver and everything it started -- the srun
    clients of every step) and everything of the job on ``host``, and the node's slurmd, SIGKILL. The time."""
    slurmd = int((conf.parent / f"slurmd-{host}.pid").read_text().strip())

    def victims() -> list[int]:
        batch = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline")
                 if _cmdline(p).startswith(f"slurmstepd: [{job_id}.batch]")]
        return [slurmd, *_descendants(batch + _step_daemons(out, host))]

    return _lose(victims)


def _step_daemons(out: Path, host: str) -> list[int]:
    """The slurmstepd of each training process on ``host``."""
    return sorted({_up_to_stepd(rank)[-1] for rank in rank_pids(out, host)})


def _lose(find: Callable[[], list[int]]) -> float:
    """Everything ``find`` names (parents before children) gone at once, as on a node that lost power: all stopped
    first -- again until no new process appears (one forked while the set was read would live on) -- then all
    killed, children first. One by one, a process could see another die and act in between: srun's shepherd child
    cancels its job step when the srun above it dies, and a stopped process group whose parent dies is orphaned --
    the kernel sends its members SIGHUP and SIGCONT, and an srun that wakes to it cancels its step (both did so to
    the sentinel's step on a loaded CI box). The time of the fault."""
    when, stopped = time.time(), []
    for _ in range(50):
        new = [pid for pid in dict.fromkeys(find()) if pid not in stopped]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped += new
    for pid in reversed(stopped):
        _signal(pid, signal.SIGKILL)
    return when


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _cmdline(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def reached(out: Path) -> int:
    """The step rank 0 last reported (``step`` in the output folder), -1 before the first."""
    try:
        return int((out / "step").read_text() or -1)
    except (OSError, ValueError):
        return -1


def wait_until(predicate, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll)
    raise TimeoutError(f"timed out waiting for {what}")
