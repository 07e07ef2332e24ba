"""Each rank's own log inside a Slurm job: ``$TRAINSTACK_JOB_DIR/rank-<r>.out`` next to the combined log, so the
output of the rank that failed is not lost among the others'. Torch-free.

The process's stdout and stderr (file descriptors 1 and 2, so C++ and child output too) go through a ``tee``
child that writes the file and passes everything on to the original stdout. Nothing happens outside a trainstack
job, or when the job script already tees this task (``TRAINSTACK_RANK_LOG`` set, the ``srun`` launcher).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .._common import envvars as envvars
from .._common.jobfiles import rank_log

__all__ = ["tee_rank_output", "close"]

_tee: subprocess.Popen | None = None
_saved: tuple[int, int] | None = None


def tee_rank_output(rank: int, environ: dict[str, str] | None = None) -> Path | None:
    """Start copying this process's output into the job folder's ``rank-<rank>.out`` (once per process)."""
    global _tee, _saved
    env = os.environ if environ is None else environ
    folder = env.get(envvars.JOB_DIR)
    if _tee is not None or not folder or env.get(envvars.RANK_LOG) or shutil.which("tee") is None \
            or not Path(folder).is_dir():
        return None
    path = Path(folder) / rank_log(rank)
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        out = os.dup(1)
        try:
            # signals meant for the program (a Ctrl-C, scancel --signal to the steps) must not cut its log short
            tee = subprocess.Popen(["sh", "-c", 'trap "" USR1 USR2 TERM INT HUP; exec tee -a "$0"', str(path)],
                                   stdin=subprocess.PIPE, stdout=out, start_new_session=True)
        finally:
            os.close(out)
    except OSError:  # the job folder is not writable from here: the combined log still has everything
        return None
    assert tee.stdin is not None
    _saved = (os.dup(1), os.dup(2))
    os.dup2(tee.stdin.fileno(), 1)
    os.dup2(tee.stdin.fileno(), 2)
    tee.stdin.close()
    _tee = tee
    os.environ[envvars.RANK_LOG] = str(path)  # child processes write through this one
    atexit.register(close)
    return path


def close(timeout: float = 5.0) -> None:
    """Flush, give the original descriptors back and let ``tee`` write the last lines before the process ends."""
    global _tee, _saved
    if _tee is None or _saved is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os.dup2(_saved[0], 1)
    os.dup2(_saved[1], 2)
    os.close(_saved[0])
    os.close(_saved[1])
    try:
        _tee.wait(timeout)
    except subprocess.TimeoutExpired:
        _tee.kill()
    _tee, _saved = None, None
