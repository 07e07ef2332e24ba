"""Imported only by the workers' fork server (first in its preload list, see :mod:`trainstack._preload`).

Slurm and ``kill`` may signal every process of a job step: the server must outlive a stop signal, because its
death would take the workers down (their parent-death signal) while they write their preemption checkpoint. It
exits when the launching process does. Workers restore the default dispositions first thing
(``trainstack._launcher._worker``).
"""

import signal

from ._preload import SERVER_IGNORES

for _sig in SERVER_IGNORES:
    signal.signal(_sig, signal.SIG_IGN)
