"""Workers start from an interpreter that has already imported torch: multiprocessing's forkserver, preloaded.

A spawned worker re-imports torch (~1 s) and, at its first optimizer step, ``torch._dynamo`` (~1 s): N workers pay
that N times, competing for the same cores, at every start and every restart. The fork server imports them once,
in its own process, started as soon as the launching process knows it will need workers (``TrainConfig`` or
``Accelerator`` with ``nprocs > 1``), so the import overlaps the script building its model, optimizer and data;
each worker is then a fork of it (milliseconds). The server itself never touches CUDA, a process group or a
thread pool, so forking it is safe; workers still get plain-pickled private copies of the user's objects and the
launching process's environment *at launch time* (the server's was fixed when it started).

The server is **private** to trainstack: the user's own ``multiprocessing.get_context("forkserver")`` processes
(and ``ProcessPoolExecutor`` workers) go to Python's ordinary fork server, never to this one, so they neither
inherit its ignored stop signals nor its preloaded state. A module that fails to preload is reported and skipped.

``TRAINSTACK_PRELOAD=0`` turns this off (workers are spawned); ``TRAINSTACK_PRELOAD=mod1,mod2`` preloads these
modules as well (e.g. ``transformers``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator

from .._common import envvars as envvars

log = logging.getLogger("trainstack")

__all__ = ["enabled", "modules", "private_tempdir", "start", "start_for", "server_pid", "serving", "server_environ"]

# What every worker imports anyway: torch, the parts the first step and the process group pull in, and ours.
_DEFAULT = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.utils.data", "trainstack",
            "trainstack._runtime.spawn", "trainstack.trainer")
#: The one module the server is told to preload; it ignores stop signals and imports the rest, reporting failures.
_INIT = "trainstack._runtime.forkserver_init"

_SERVER = multiprocessing.forkserver.ForkServer()
_SERVER_ENV: dict[str, str] = {}  # the environment the server started with (what torch read at import)
_LOCK = threading.Lock()


# What the server ignores (trainstack._runtime.forkserver_init) and its workers restore first thing.
SERVER_IGNORES = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT"))


def enabled() -> bool:
    """False when ``TRAINSTACK_PRELOAD=0`` (or ``no``/``off``/``false``)."""
    return os.environ.get(envvars.PRELOAD, "1").strip().lower() not in ("0", "no", "off", "false")


def modules() -> list[str]:
    """The defaults plus the modules named in ``TRAINSTACK_PRELOAD`` (a comma-separated list)."""
    extra = [m.strip() for m in os.environ.get(envvars.PRELOAD, "").split(",")
             if m.strip() and m.strip().lower() not in ("1", "yes", "on", "true")]
    return list(dict.fromkeys([*_DEFAULT, *extra]))


_MAX_SOCKET_DIR = 88  # + "/listener-XXXXXXXX" must fit AF_UNIX's 107 bytes


def _private_dir(base: str | None) -> str:
    path = tempfile.mkdtemp(prefix="trainstack-", dir=base)  # 0700
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                                  exitpriority=-100)
    return path


_PRIVATE: dict[str | None, str] = {}


def private_tempdir() -> str:
    """This process's private (0700) folder in the temp folder, removed at exit: every launch's files live in it,
    and the fork server's socket too (unless the path is too long for a socket), so a SIGKILLed launcher leaves
    one folder behind, never several. ``TMPDIR`` is read now, not when Python first looked (a script may set it
    after importing trainstack)."""
    base = os.environ.get("TMPDIR") or None
    if base is not None and not os.path.isdir(base):
        base = None  # tempfile's own fallbacks
    folder = _PRIVATE.get(base)
    if folder is None or not os.path.isdir(folder):
        folder = _PRIVATE[base] = _private_dir(base)
    return folder


def _socket_dir() -> None:
    """Where multiprocessing puts the server's socket (its own choice would be another pymp-* folder)."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]  # multiprocessing's own
    if config.get("tempdir") and os.path.isdir(config["tempdir"]):
        return
    private = private_tempdir()
    config["tempdir"] = private if len(private) <= _MAX_SOCKET_DIR else _private_dir("/tmp")


def start() -> bool:
    """Start the fork server now, without waiting for its imports (it loads them in its own process); False when
    it is off or cannot run here (then workers are spawned: the same result, only slower to start)."""
    if not enabled():
        return False
    with _LOCK:
        _socket_dir()
        _SERVER.set_forkserver_preload([_INIT])
        env = dict(os.environ)
        try:
            _SERVER.ensure_running()
        except OSError as exc:  # e.g. a socket path too long for AF_UNIX
            log.debug("fork server not started (%s); workers will be spawned", exc)
            return False
        pid = str(server_pid())
        if _SERVER_ENV.get("__pid") != pid:
            _SERVER_ENV.clear()
            _SERVER_ENV.update(env, __pid=pid)
    return True


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """While workers start: multiprocessing's forkserver processes ask the module-level ``connect_to_new_process``
    for a server; ours answers instead of Python's shared one (which the user's own processes keep using)."""
    module = multiprocessing.forkserver
    with _LOCK:
        saved = module.connect_to_new_process
        module.connect_to_new_process = _SERVER.connect_to_new_process
        try:
            yield
        finally:
            module.connect_to_new_process = saved


def server_environ() -> dict[str, str]:
    """The environment the running server was started with (empty when none runs): what torch read at import."""
    return {k: v for k, v in _SERVER_ENV.items() if k != "__pid"}


def start_for(nprocs: int) -> None:
    """Start the server early when this process will start ``nprocs`` local workers: a script (not a notebook),
    not itself a worker, and not under a launcher that starts the processes itself (torchrun, srun per process)."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs <= 1 or not enabled():
        return
    if os.environ.get(envvars.START_METHOD, "forkserver") != "forkserver":
        return
    if multiprocessing.parent_process() is not None or getattr(multiprocessing.current_process(), "_inheriting",
                                                               False):
        return
    main = sys.modules.get("__main__")
    if main is None or not hasattr(main, "__file__"):
        return
    from ..environment import detect_environment
    from ..errors import TrainstackError
    from .layout import plan_processes

    try:
        env = detect_environment()
        if env.name != "torchrun" and plan_processes(env, nprocs).spawn:
            start()
    except TrainstackError:  # the launch reports a bad layout itself, with its message
        return


def server_pid() -> int | None:
    """The fork server's pid while one runs for this process (it exits with this process)."""
    return getattr(_SERVER, "_forkserver_pid", None)
