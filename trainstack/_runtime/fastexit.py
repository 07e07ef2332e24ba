"""A failed rank of a multi-process run leaves as soon as it has said why, and never burns CPU on the way out.

After an uncaught exception, CPython tears the interpreter down module by module; with torch loaded that is 1-1.5 s
of CPU per process (measured on the local Slurm: the error printed, the process gone 1.0-2.1 s later). During a
recovery those seconds run beside the next step's processes, which import torch on the same cores. Armed by a rank
that joins a process group of more than one process: the hook before it prints the traceback, the exit handlers
run (``atexit``: the rank log's tee, torch's own), every open file is flushed, then the process ends with status 1
without the teardown -- what trainstack's fork server already does at its exit.

A rank that failed because another did (a lost peer) is not the failure's cause: outside a job it keeps Python's
own exit (its 1-1.5 s keep the launcher's first failure the cause, as before); in a job it first says so in the job
folder (``peers-lost/``: the driver's detection, at once, of a node lost with no exit of its own to record),
then sleeps ``SECONDARY_WAIT_S`` (no CPU) before it leaves, so that the rank that caused it -- perhaps through
Python's slower exit (``sys.exit``), perhaps under a torchrun agent -- ends first and stays the job's first failing
task; the driver's teardown usually kills it while it sleeps. A SIGTERM ends the sleep (one that came while the
rank was still unwinding too; it then leaves with 143, as if killed): the launcher's stop after the first failure
-- srun's ``--kill-on-bad-exit``, or a torchrun agent that waits for its node's other workers before it reports the
failure and exits.
``TRAINSTACK_FAST_EXIT=0`` keeps Python's own exit; Ctrl-C (``KeyboardInterrupt``) and ``SystemExit`` keep it too:
their exit statuses are the interpreter's to give.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from .._common import envvars as envvars
from .._common.jobfiles import JobFiles
from . import preemption

__all__ = ["arm"]

_lock = threading.Lock()
_installed: list[Callable[[type[BaseException], BaseException, TracebackType | None], None]] = []  # newest last
FAILED_STATUS = 1  # what Python's own exit gives an uncaught exception
# Errors a rank raises because *another* rank died; never reported as the root cause when a better one exists.
SECONDARY = ("remote worker", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted", "ncclRemoteError", "remote process exited", "SIGINT")
SECONDARY_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
#: A rank that failed because another did waits this long (asleep: no CPU) before it leaves, so that the rank that
#: failed first -- perhaps through Python's slower exit (``sys.exit``) -- also ends first: the job's status and
#: verdict are the first failing task's. The launcher (srun's --kill-on-bad-exit, the driver, torchrun) ends it
#: sooner.
SECONDARY_WAIT_S = 3.0
_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what a launcher stops the others with
THREADS_WAIT_S = 30.0  # Python would wait for ever on a thread stuck on a lost peer


def arm(rank: int) -> None:
    """Make the hook the outermost ``sys.excepthook`` (again, where a hook installed since wraps it: torch's
    ``init_process_group`` installs one that prefixes the traceback's lines with the rank); a no-op where
    ``TRAINSTACK_FAST_EXIT=0``. Call it after the process group is initialised, with this process's global rank
    (under srun no ``RANK`` is in the environment)."""
    if os.environ.get(envvars.FAST_EXIT, "1") == "0":
        return
    with _lock:
        if _installed and sys.excepthook is _installed[-1]:
            return
        previous, stderr = sys.excepthook, sys.stderr

        def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            previous(kind, value, tb)
            # Ctrl-C keeps Python's exit status; a hook that wraps this one (its stderr swapped for a buffer it
            # writes out after) gets Python's exit too: leaving here would lose the traceback it holds
            if issubclass(kind, KeyboardInterrupt) or sys.stderr is not stderr:
                return
            if secondary(kind, value):
                if not _say_peer_lost(rank):
                    return  # outside a job nobody reads the signal: Python's own (slower) exit keeps the order
                stopped = _wait_unless_stopped(SECONDARY_WAIT_S)
                if stopped in _STOPS:  # the launcher's stop: the status its signal gives (srun's 143 for the others)
                    leave(128 + stopped)
            leave(FAILED_STATUS)

        _installed.append(hook)
        sys.excepthook = hook


def _wait_unless_stopped(seconds: float) -> int | None:
    """Sleep ``seconds`` (no CPU) unless a SIGTERM comes meanwhile or a stop signal came while this rank was
    unwinding; the signal that ended the wait, if one did."""
    came = preemption.signalled_within(seconds)
    if came or threading.current_thread() is not threading.main_thread():
        return came
    stopped: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    try:
        deadline = time.monotonic() + seconds
        while not stopped and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return stopped[0] if stopped else None


def secondary(kind: type[BaseException], value: BaseException) -> bool:
    """Did this rank fail because another rank died (torch's distributed errors; a RuntimeError of the backend
    naming a lost peer)? A program's own ``BrokenPipeError`` is its own failure."""
    if kind.__name__ in SECONDARY_TYPES:
        return True
    return issubclass(kind, RuntimeError) and any(marker in str(value) for marker in SECONDARY)


def _say_peer_lost(rank: int) -> bool:
    """In a job (its folder and step in the environment): this rank lost a peer and is still alive. False outside
    one (a local run: its launcher -- trainstack's spawn, torchrun -- picks the cause by its own means)."""
    folder = JobFiles.current()
    if folder is not None:
        folder.step.peer_lost(rank, this_host(), int(os.environ.get(envvars.STEP, "0") or 0))
    return folder is not None


def this_host() -> str:
    """This node's name as the job folder's records spell it (Slurm's, else the host name)."""
    return os.environ.get(envvars.NODE_NAME) or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def leave(status: int) -> None:
    """What Python's exit does first -- wait for the program's own (non-daemon) threads, here at most
    ``THREADS_WAIT_S`` in all, then run the exit handlers -- then flush every open file and end the process with
    ``status``, without the teardown."""
    try:
        deadline = time.monotonic() + THREADS_WAIT_S
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join(max(0.0, deadline - time.monotonic()))
        atexit._run_exitfuncs()
    finally:
        _flush_open_files()
        os._exit(status)


def _flush_open_files() -> None:
    """What the teardown would have flushed: text files first (their buffers feed the binary ones), then binary."""
    found = [obj for obj in gc.get_objects() if isinstance(obj, io.IOBase)]
    for layer in (io.TextIOBase, io.BufferedIOBase):
        for stream in found:
            if isinstance(stream, layer):
                try:
                    if not stream.closed and stream.writable():
                        stream.flush()
                except (OSError, ValueError):  # a full disk, a closed pipe: nothing more to do for it
                    pass
