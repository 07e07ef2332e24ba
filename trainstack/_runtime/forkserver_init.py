"""Imported only by the workers' fork server: the one module it is told to preload (``.preload``).

Slurm and ``kill`` may signal every process of a job step: the server must outlive a stop signal, because its
death would take the workers down (their parent-death signal) while they write their preemption checkpoint. It
exits when the launching process does. Workers restore the default dispositions first thing
(``trainstack._runtime.spawn._worker``). Then it imports what every worker needs; a module that fails to import (not
only with ImportError: Python's own preloading would let any other exception kill the server) is reported and
skipped. When the launching process exits, the server leaves at once (``os._exit``): its interpreter's teardown
after importing torch takes ~1 s, during which it still holds the launcher's stdout -- a caller reading that
output (a pipe, ``subprocess.run(capture_output=True)``) would wait for it.
"""

import atexit
import os
import signal
import sys

from .preload import SERVER_IGNORES, modules

for _sig in SERVER_IGNORES:
    signal.signal(_sig, signal.SIG_IGN)

for _name in modules():
    try:
        __import__(_name)
    except BaseException as _exc:  # noqa: BLE001 - a broken module must not take the server down
        print(f"trainstack: preloading {_name!r} for the worker processes failed ({type(_exc).__name__}: {_exc}); "
              f"the workers import it themselves if they need it.", file=sys.stderr, flush=True)


_SERVER_PID = os.getpid()


def _leave_at_once() -> None:
    if os.getpid() == _SERVER_PID:  # never in a worker (forked from the server; they leave through os._exit anyway)
        os._exit(0)


atexit.register(_leave_at_once)  # the last registered runs first: nothing of the server's teardown is needed
