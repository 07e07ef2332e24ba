"""The allocation driver's keeper: the job script's process runs the driver as its child and outlives it. A driver
that dies -- the OOM killer, a ``kill -9``, a crash that skipped its end -- is a failure like any other: said in the
job's log, its timeline and its verdicts ("the allocation driver died: ..."), the job steps it left are killed, and
a new driver takes over the same allocation (its steps numbered on, its ranks resumed from the newest complete
checkpoint). After ``TAKEOVERS`` deaths in one allocation the job is requeued (``--requeue``) or ends.

The keeper is small on purpose -- no thread, no Slurm call but the cleanup, a few kilobytes -- so it is never the
process the OOM killer picks, and it forwards every stop signal Slurm sends the batch script to the driver.
Torch-free, stdlib only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

from .._common.jobfiles import JobFiles

__all__ = ["Keeper", "TAKEOVERS"]

#: New drivers one allocation may start after a driver's death before the job is requeued (or ends).
TAKEOVERS = 2
#: The signals Slurm (or a user) sends the batch script: the driver acts on them.
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_CHILD_SUBREAPER = 36


class Keeper:
    """Runs ``drive(takeover)`` in a child process until one finishes its run (a driver killed, or crashed past
    Python, never says it did);
    ``cleanup()`` kills the job steps a dead driver left, ``requeue()`` requeues the job (False where it cannot)."""

    def __init__(self, files: JobFiles, drive: Callable[[int], int], cleanup: Callable[[], None],
                 requeue: Callable[[], bool], emit: Callable[[str, bool], None], takeovers: int = TAKEOVERS) -> None:
        self.files, self.drive, self.cleanup, self.requeue, self.emit = files, drive, cleanup, requeue, emit
        self.takeovers = takeovers
        self.child = self.last_pid = 0
        self.host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename

    def run(self) -> int:
        """The job's exit status: the last driver's."""
        _become_subreaper()  # the sruns a dead driver leaves become ours: reaped, never zombies
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        takeover = 0
        while True:
            code, ended = self._run_driver(takeover)
            if ended:  # the driver finished its run (its job folder may be gone: a pipe, not a file, says so)
                return code
            if self.files.driver.replaced(self.host, self.last_pid):  # a sentinel's driver runs the job now
                return self._stand_aside()
            why = _describe(code)
            takeover += 1
            if takeover > self.takeovers:
                return self._give_up(why, code)
            self._record(why, takeover)
            self.cleanup()

    def _run_driver(self, takeover: int) -> tuple[int, bool]:
        """One driver, run to its end: (its exit status, whether it finished its run -- said through a pipe as its
        last act; a driver killed or crashed past Python says nothing)."""
        sys.stdout.flush()
        sys.stderr.flush()
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the driver
            os.close(done_r)
            for sig in FORWARDED:
                signal.signal(sig, signal.SIG_DFL)
            code = 1
            try:
                code = self.drive(takeover)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.write(done_w, b"1")
                os._exit(code)
        os.close(done_w)
        self.child = self.last_pid = pid
        try:
            while True:
                try:
                    found, status = os.waitpid(-1, 0)
                except ChildProcessError:
                    return 1, False
                except InterruptedError:  # a forwarded signal
                    continue
                if found == pid:
                    self.child = 0
                    return os.waitstatus_to_exitcode(status), os.read(done_r, 1) == b"1"
        finally:
            os.close(done_r)

    def _stand_aside(self) -> int:
        """Another driver took the allocation over (a sentinel took this host for lost): its steps are not ours to
        kill, and the job must not end with this script -- wait for the new driver to end the job (Slurm's signal)."""
        now = self.files.driver.host()
        self.emit(f"the allocation is driven from {now[0] if now else 'another node'} now: this batch script waits "
                  f"for its end", True)
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        while True:
            signal.pause()

    def _forward(self, signum: int, frame: object) -> None:
        if self.child:
            try:
                os.kill(self.child, signum)
            except ProcessLookupError:
                pass

    def _record(self, why: str, takeover: int) -> None:
        line = (f"the allocation driver died ({why}) without ending the job: killing the job steps it left; a new "
                f"driver takes over the allocation (takeover {takeover} of {self.takeovers})")
        self.emit(line, True)
        self.files.record_event("driver_died", why=why, takeover=takeover)
        self.files.append_verdict({"attempt": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                                   "step_index": _last_step(self.files), "category": "driver",
                                   "kind": "driver died", "summary": f"the allocation driver died ({why})",
                                   "cause": f"driver died: {why}", "rank": None, "host": None, "blamed": None,
                                   "step": None, "status": None, "time": time.time(), "retried": True,
                                   "excluded": [], "decision": line})

    def _give_up(self, why: str, code: int) -> int:
        self.cleanup()
        requeued = self.requeue()
        line = (f"the allocation driver died ({why}) {self.takeovers + 1} times in this allocation: "
                + ("the job is requeued" if requeued else "the job ends"))
        self.emit(line, True)
        self.files.record_event("driver_died", why=why, takeover=None, requeued=requeued)
        self.files.driver.ended(f"driver died: {why}")
        self.files.write_exit_code(code if code else 1)
        return 0 if requeued else (code or 1)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _last_step(files: JobFiles) -> int:
    """The job step index the dead driver had reached in this attempt (its timeline's last step event)."""
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    steps = [e.get("step_index") for e in files.events() if e.get("attempt") == restart
             and e.get("kind") in ("step_start", "relaunch", "step_end")]
    return max((s for s in steps if type(s) is int), default=0)


def next_step(files: JobFiles) -> int:
    """The first job step index a driver that takes over starts from (after the dead one's)."""
    return _last_step(files) + 1


def _become_subreaper() -> None:
    """Orphaned descendants (a dead driver's sruns) are reparented to this process (Linux), not to init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
