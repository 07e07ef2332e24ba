"""Start worker processes, rendezvous them into one process group, and tear everything down cleanly.

Design choices:
* Arguments are serialised with plain ``pickle`` before spawning, so each worker gets its **own copy**
  of the model; torch's multiprocessing reductions would put CPU tensors in shared memory and apply every
  optimizer step once per process.
* The launching process hosts the rendezvous ``TCPStore`` (port 0 = the OS picks a free one, no races).
  When a worker hosts it instead (``srun`` with one task per process), it waits until every rank has
  left the group before it exits, which avoids the "terminate called without an active exception" crash.
* Workers are started with ``torch.multiprocessing.start_processes``, forked from a server that has torch
  imported already (``forkserver``, see ``trainstack._runtime.preload``; ``spawn`` with ``TRAINSTACK_PRELOAD=0``,
  ``fork`` in notebooks), and they take the launching process's environment as it is at launch; when one
  fails, the others are terminated within a grace period and the caller gets
  ``WorkerError`` naming the rank with the worker's traceback, sent as text through a
  private (0700) folder: nothing another local user could write is ever unpickled. A worker that ends without
  finishing (``sys.exit(0)`` in library code, a Ctrl-C that reached only the workers) is a failure too.
* Workers die with their launcher, whatever kills it (even SIGKILL): each one watches the launcher's end of a
  pipe and exits within a second of it closing, and file descriptors the launcher shares with them (the run
  folder's lock) stay held until the last worker is gone.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import re
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from .._common import envvars as envvars
from .._common.files import atomic_write
from ..errors import Interrupted, LaunchError, Preempted, TrainingHung
from . import fastexit
from . import preload as _preload
from . import ranklog as _ranklog
from .carried import carried_header, worker_error
from .layout import ProcessPlan, WorkerContext
from .pgsession import ProcessGroupSession, _timeout, wait_for_count
from .startup import MAIN_GUARD, check_main_guard, check_not_bootstrapping, start_method
from .watchdog import HANG_EXIT_CODE, HANG_REPORT, watched

__all__ = ["ProcessGroupSession", "launch", "check_not_bootstrapping"]  # the session: pgsession.py

log = logging.getLogger(__name__)

_RESULT = "result.pkl"
_DONE = "done-{}"  # a worker that returned (rank 0 also wrote the result); exit 0 without it is a failure
_INTERRUPTED = "interrupted"  # created by the launching process at the first Ctrl-C (interruptible launches)
GRACE_PERIOD_S = 3.0
@dataclass(frozen=True)
class _WorkerSpec:
    """What a spawned worker needs besides the user's call (picklable, no torch objects)."""

    plan: ProcessPlan
    backend: str
    device_type: str  # "cpu" or "cuda"
    gpus: int
    store_port: int
    hang_timeout: float = 0.0  # the watchdog (0: only on-demand dumps when a job folder is set)
    hang_dir: str = "."
    environ: dict[str, str] | None = None  # the launching process's, at launch (a fork server's is older)
    umask: int = 0o022  # the launching process's, at launch
    rlimits: tuple[tuple[int, int, int], ...] = ()  # (resource, soft, hard) of the launching process
    keep_open: tuple[Any, ...] = field(default_factory=tuple)  # _SharedFd: held by every worker until it exits
    stdio: tuple[Any, ...] = ()  # _SharedFd of the launching process's stdout and stderr (a fork server's are older)
    interruptible: bool = False  # the launching process turns a first Ctrl-C into a graceful stop (the Trainer)
    timeout_s: float | None = None  # the collective timeout the program chose (None: the environment's)
    start_method: str | None = None  # the launching process's default: what the user's DataLoaders would use


class _SharedFd:
    """A file descriptor of the launching process that each worker receives a duplicate of (the same open file:
    an flock on it stays held while any worker lives). Duplicated when the worker is started, per worker."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detach, (multiprocessing.reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return int(dup.detach())


#: Resource limits a worker takes over from its launcher at launch (a fork server's are from its own start).
_RLIMITS = tuple(getattr(resource, name) for name in ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS")
                 if hasattr(resource, name))


def _launcher_state() -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """This process's umask and resource limits, for workers forked from a server that started earlier."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask, tuple((r, *resource.getrlimit(r)) for r in _RLIMITS)


def _take_environ(spec: _WorkerSpec) -> None:
    """Make the worker's process state the launching process's at launch time, as spawning would have: the
    environment, the umask, resource limits, the temp folder, and the torch settings read from variables."""
    if spec.environ is None:
        return
    server_env = dict(os.environ)  # a fork of the server: what torch read when the server imported it
    os.environ.clear()
    os.environ.update(spec.environ)
    os.umask(spec.umask)
    for which, soft, hard in spec.rlimits:
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):  # e.g. a hard limit raised after the server started: not ours to raise
            pass
    tempfile.tempdir = None  # tempfile read TMPDIR once, in the server
    for target, fd in zip((1, 2), spec.stdio, strict=False):  # print where the launching process prints now
        with contextlib.suppress(OSError, ValueError):
            (sys.stdout if target == 1 else sys.stderr).flush()
        os.dup2(fd, target)
        os.close(fd)
    threads = spec.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))  # torch read the variable when the server imported it
    for name, apply in _REAPPLIED.items():
        if spec.environ.get(name) != server_env.get(name):
            apply(spec.environ.get(name))


def _set_compile_disable(value: str | None) -> None:
    import torch._dynamo.config

    torch._dynamo.config.disable = value == "1"


def _set_distributed_debug(value: str | None) -> None:
    dist.set_debug_level_from_env()


#: Variables torch reads once at import, which the worker re-applies when they changed after the server started.
_REAPPLIED: dict[str, Callable[[str | None], None]] = {"TORCH_COMPILE_DISABLE": _set_compile_disable,
                                                       "TORCH_DISTRIBUTED_DEBUG": _set_distributed_debug}


def _torch_default(name: str, before: dict[str, str]) -> bool:
    """True when torch itself filled ``name`` in with its default (inductor does so for its cache folder when it
    first needs it): not the user's change, never worth a warning."""
    if name != "TORCHINDUCTOR_CACHE_DIR" or name in before:
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.environ.get(name) == os.path.abspath(default_cache_dir())


def _warn_on_frozen_variables() -> None:
    """Torch settings read at import by the fork server that changed since, and that cannot be re-applied."""
    before = _preload.server_environ()
    if not before:
        return
    changed = sorted(k for k in set(before) | set(os.environ)
                     if k.startswith(("TORCH", "CUDA_", "NCCL_", "PYTORCH_")) and k not in _REAPPLIED
                     and before.get(k) != os.environ.get(k) and not _torch_default(k, before))
    if changed:
        log.warning("%s changed after the workers' fork server started (TrainConfig/Accelerator with nprocs > 1 "
                    "starts it); the workers see the new value in os.environ, but torch may have read the old one "
                    "at import. HINT: set these before creating the TrainConfig/Accelerator, or "
                    "TRAINSTACK_PRELOAD=0.", ", ".join(changed))


def _die_with_launcher() -> None:
    """Exit within a second of the launching process ending, however it ended (a SIGKILL included): the worker's
    end of multiprocessing's parent pipe reads EOF once the launcher's copy is closed by its death."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return
    server: Any = multiprocessing.forkserver._forkserver  # CPython's own singleton
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:  # the server's "alive" pipe: held here, it would keep the server up after the launcher
        os.close(alive)
        server._forkserver_alive_fd = None

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        print(f"trainstack: the launching process is gone; worker {os.getpid()} stops.", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="trainstack-launcher-watch", daemon=True).start()


def _set_child_environ(ctx: WorkerContext) -> None:
    """Export the usual env:// variables in the worker (never in the launching process)."""
    os.environ.update({
        "RANK": str(ctx.rank), "LOCAL_RANK": str(ctx.local_rank), "WORLD_SIZE": str(ctx.world_size),
        "LOCAL_WORLD_SIZE": str(ctx.local_world_size), "GROUP_RANK": str(ctx.node_rank),
        "MASTER_ADDR": ctx.master_addr, "MASTER_PORT": str(ctx.master_port),
    })


def _worker(local_index: int, payload: Any, spec: _WorkerSpec, private_dir: str) -> None:
    """Entry point of a spawned worker: join the group, run the function, hand rank 0's result back.

    A failure is reported as plain text in the launch's private folder (never as a pickle: the launching process
    must not unpickle anything another local user could have written).
    """
    _die_with_launcher()
    _take_environ(spec)
    if spec.environ is not None:  # forked from the fork server, which ignores stop signals (_forkserver_init)
        for sig in _preload.SERVER_IGNORES:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    if spec.interruptible:  # until the Trainer's handler is in place, Ctrl-C is the launching process's to relay
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ[envvars.INTERRUPT_FILE] = os.path.join(private_dir, _INTERRUPTED)
    if spec.start_method is not None:  # a worker born of a fork server inherits its method: a DataLoader's workers
        multiprocessing.set_start_method(spec.start_method, force=True)  # would outlive the rank; the user's own
    atomic_write(os.path.join(private_dir, f"started-{local_index}"), b"", mode=0o600)
    os.environ[envvars.ERROR_REPORT] = os.path.join(private_dir, f"error-{local_index}.txt")
    try:
        ctx = spec.plan.context(local_index, spec.device_type, spec.gpus, port=spec.store_port)
        _set_child_environ(ctx)
        fn, args, kwargs = pickle.loads(payload) if isinstance(payload, bytes) else payload
        with ProcessGroupSession(ctx, spec.backend, timeout_s=spec.timeout_s), \
                watched(ctx.rank, ctx.world_size, spec.hang_timeout, Path(spec.hang_dir)):
            try:
                result = fn(*args, **kwargs)
            except Preempted:  # a graceful stop inside a worker (a Trainer run in a distributed function)
                result = None
        if ctx.rank == 0:
            atomic_write(os.path.join(private_dir, _RESULT), pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL),
                         mode=0o600)
        atomic_write(os.path.join(private_dir, _DONE.format(local_index)), b"", mode=0o600)
    except BaseException as exc:
        atomic_write(os.path.join(private_dir, f"error-{local_index}.txt"), _failure_text(exc).encode(
            "utf-8", "replace"), mode=0o600)
        _stop_children()
        raise
    _exit_cleanly()


def _stop_children(timeout: float = 2.0) -> None:
    """A worker's own processes end with it -- DataLoader workers, persistent ones included, which would otherwise
    live on holding the launcher's stdout (``python train.py | tee log`` never ended)."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout)


def _failure_text(exc: BaseException) -> str:
    """What the launching process reports for a worker that did not finish; exits that are not errors in Python
    (``sys.exit(0)``, a Ctrl-C that reached only the workers) still ended it without a result."""
    text = carried_header(exc) + "".join(traceback.format_exception(exc)).strip()
    if isinstance(exc, SystemExit):
        return (f"{text}\nthe worker called sys.exit({exc.code!r}) before its function returned (in a callback or "
                f"library code?), so it has no result.")
    if isinstance(exc, KeyboardInterrupt):
        return f"{text}\nthe worker was interrupted (SIGINT) before its function returned, so it has no result."
    return text


def _exit_cleanly() -> None:
    """End a worker whose work is done and whose group is closed without running C++ static destructors: under load,
    a torch background thread still joinable at interpreter exit aborts the process ("terminate called without an
    active exception", SIGABRT) after its result was written, and the run would be reported as failed."""
    _stop_children()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    _ranklog.close()
    os._exit(0)


def _ctrl_c(detail: str) -> str:
    """Where a worker stopped when a Ctrl-C (KeyboardInterrupt) ended it -- ``train at own.py:6`` -- else ''."""
    lines = [line for line in detail.splitlines() if line.strip()]
    if not any(line.startswith("KeyboardInterrupt") for line in lines[-3:]):
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', detail)
    mine = [f for f in frames if "/trainstack/" not in f[0] and "/site-packages/" not in f[0]] or frames
    return f"{mine[-1][2]} at {os.path.basename(mine[-1][0])}:{mine[-1][1]}" if mine else "its function"


def _serialise(fn: Callable, args: tuple, kwargs: dict, method: str) -> Any:
    """Pickle the call so each worker gets a private copy (fork copies memory by itself): plain pickle, else
    cloudpickle, which sends closures and lambdas by value (a LambdaLR's local function, a lambda loss_fn) as
    launchers that re-run the script (torchrun, Lightning's ddp) never needed to."""
    if method == "fork":
        return (fn, args, kwargs)
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    try:
        import cloudpickle  # type: ignore[import-untyped]

        return cloudpickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # cloudpickle raises what the object's own reducer raises
        first = exc
    name = getattr(fn, "__qualname__", repr(fn))
    if getattr(fn, "__module__", "").startswith("trainstack"):
        raise LaunchError(
            f"cannot send the Trainer to the worker processes: {first}.\nOn python train.py with nprocs > 1, "
            "everything given to the Trainer (model, optimizer, loss_fn, scheduler, callbacks, loaders) is copied "
            "into each worker, so it must be picklable: a lock, an open file, a generator or a live connection is "
            "not. HINT: create it inside the object that uses it (lazily), or run under torchrun / srun, where "
            "every process builds its own objects and nothing is pickled.") from None
    raise LaunchError(
        f"cannot send {name!r} and its arguments to the worker processes: {first}.\n"
        "Workers are new processes, so the function and every argument must be picklable: define "
        "the function at module top level (not a lambda or a function inside another function) and "
        + MAIN_GUARD) from None


def _host_store(plan: ProcessPlan) -> dist.TCPStore | None:
    if not plan.hosts_store:
        return None
    addr = plan.master_addr if plan.environment.name != "local" else "127.0.0.1"
    try:
        return dist.TCPStore(addr, plan.master_port, is_master=True, timeout=_timeout(), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise LaunchError(f"cannot open the rendezvous port {addr}:{plan.master_port}: {exc}. HINT: set "
                          f"MASTER_PORT to a free port, or unset it to let trainstack choose one.") from None


def launch(fn: Callable, args: tuple, kwargs: dict, plan: ProcessPlan, backend: str, device_type: str,
           hang_timeout: float = 0.0, hang_dir: str = ".", keep_open: Sequence[int] = (),
           interruptible: bool = False, timeout_s: float | None = None) -> Any:
    """Run ``fn`` in ``plan.nprocs_local`` new processes and return rank 0's result (None elsewhere).

    ``keep_open``: file descriptors every worker holds a duplicate of until it exits (e.g. a lock's).
    ``interruptible``: the first Ctrl-C asks the workers for a graceful stop (they poll a private file), the second
    one stops them.
    """
    check_not_bootstrapping()
    check_main_guard(fn)
    method = start_method()
    payload = _serialise(fn, args, kwargs, method)
    store = _host_store(plan)
    port = store.port if store is not None else plan.master_port
    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    if method == "forkserver" and not _preload.start():  # a no-op when TrainConfig/Accelerator started it
        method = "spawn"
    if method == "forkserver":
        _warn_on_frozen_variables()
    mask, limits = _launcher_state()
    spec = _WorkerSpec(plan=plan, backend=backend, device_type=device_type, gpus=gpus, store_port=port,
                       hang_timeout=hang_timeout, hang_dir=hang_dir,
                       environ=dict(os.environ) if method == "forkserver" else None, umask=mask, rlimits=limits,
                       keep_open=tuple(_SharedFd(fd) for fd in keep_open) if method != "fork" else tuple(keep_open),
                       stdio=tuple(_SharedFd(fd) for fd in (1, 2)) if method == "forkserver" else (),
                       interruptible=interruptible, timeout_s=timeout_s,
                       start_method=multiprocessing.get_start_method(allow_none=True) or
                       multiprocessing.get_context().get_start_method())
    # mkdtemp makes the folder 0700: reports, the result and torch's own error files live where only we can write.
    with tempfile.TemporaryDirectory(prefix="launch-", dir=_preload.private_tempdir()) as private_dir:
        context = _start(payload, spec, private_dir, plan.nprocs_local, method)
        previous = _forward_stop_signals(context, os.path.join(private_dir, _INTERRUPTED) if interruptible else None)
        stopped = ""
        try:
            failure = _monitor(context, private_dir)
        except KeyboardInterrupt:
            if interruptible:  # the Trainer's second Ctrl-C: abort
                raise
            failure, stopped = None, "while the launching process waited"
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _reap(context)
        _raise_failure(failure, stopped, plan.rank_offset, interruptible)
        if store is not None:
            wait_for_count(store, plan.world_size)
        result_path = os.path.join(private_dir, _RESULT)
        if not os.path.exists(result_path):
            return None
        with open(result_path, "rb") as fh:
            return pickle.load(fh)


def _raise_failure(failure: tuple[int, str, int] | None, stopped: str, rank_offset: int, interruptible: bool
                   ) -> None:
    """What a launch that did not end well means: a custom loop's Ctrl-C (one line, exit 130), a hang the watchdog
    stopped, or the first worker's failure."""
    if failure is not None and not interruptible and _ctrl_c(failure[1]):
        stopped = f"rank {rank_offset + failure[0]} was in {_ctrl_c(failure[1])}"
    if stopped:
        said = (f"trainstack: interrupted (Ctrl-C): every worker stopped ({stopped}). What your loop saved "
                f"(save_state) is kept; load_state continues from it.")
        print(said, file=sys.stderr, flush=True)
        raise Interrupted(said)
    if failure is not None:
        index, detail, code = failure
        if code == HANG_EXIT_CODE or detail.startswith(HANG_REPORT):
            raise TrainingHung(rank_offset + index, detail, exitcode=code)
        raise worker_error(rank_offset + index, detail, exitcode=code)


def _start(payload: Any, spec: _WorkerSpec, private_dir: str, nprocs: int, method: str) -> tmp.ProcessContext:
    """Start the workers. torch names its per-worker error files in ``tempfile``'s folder: point it at ours."""
    previous = tempfile.tempdir
    tempfile.tempdir = private_dir
    try:
        with _preload.serving():
            return tmp.start_processes(_worker, args=(payload, spec, private_dir), nprocs=nprocs, join=False,
                                       start_method=method)
    finally:
        tempfile.tempdir = previous


_SECONDARY = (*fastexit.SECONDARY, *fastexit.SECONDARY_TYPES)  # what a rank says when another failed first


def _monitor(context: tmp.ProcessContext, private_dir: str) -> tuple[int, str, int] | None:
    """Wait for the workers. On the first failure, give the others a grace period, then stop them.

    Returns ``(local_index, detail, exit_code)`` of the root-cause failure, or None when all succeeded.
    """
    procs = context.processes
    failed: dict[int, float] = {}
    deadline: float | None = None
    while True:
        now = time.time()
        for i, proc in enumerate(procs):
            if i not in failed and not proc.is_alive() and (
                    proc.exitcode != 0 or not os.path.exists(os.path.join(private_dir, _DONE.format(i)))):
                failed[i] = now
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        if failed and deadline is None:
            deadline = now + GRACE_PERIOD_S
        if deadline is not None and now >= deadline:
            break  # the rest is stopped by _reap
        wait = 1.0 if deadline is None else max(deadline - now, 0.01)
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=wait)
    for i in range(len(procs)):  # still exiting at the deadline, its failure report written: it failed as well
        if i not in failed and os.path.exists(os.path.join(private_dir, f"error-{i}.txt")):
            failed[i] = time.time()
    if not failed:
        return None
    reports = []
    for i, observed in failed.items():
        detail, when = _read_error(os.path.join(private_dir, f"error-{i}.txt"), observed)
        code = procs[i].exitcode  # None: still exiting (it is stopped next)
        if detail is None:
            started = os.path.exists(os.path.join(private_dir, f"started-{i}"))
            detail = _describe_exit(code or 0) if started else _died_while_importing(code or 0)
        secondary = any(marker in detail for marker in _SECONDARY) and code != 0
        reports.append((secondary, when, i, detail, code or 0))
    _, _, index, detail, code = min(reports)
    return index, detail, code


def _read_error(path: str, observed: float) -> tuple[str | None, float]:
    """The traceback a worker wrote as text into the private folder, with the time it was written."""
    try:
        when = os.path.getmtime(path)
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip() or None, when
    except OSError:
        return None, observed


def _forward_stop_signals(context: tmp.ProcessContext, interrupt_file: str | None = None
                          ) -> dict[signal.Signals, Any]:
    """While workers run, relay stop signals sent to this (launching) process to them, as torchrun does.

    Without this, ``kill -USR2 <launcher>`` (or Slurm signalling a task that spawned its share) would kill the
    launcher and, through PDEATHSIG, the workers before they could checkpoint. With ``interrupt_file``, the first
    Ctrl-C creates it (the workers stop gracefully at their next stop check) and the second raises
    KeyboardInterrupt; a launcher that ignores SIGINT (started with ``&`` from a script) keeps ignoring it.
    """
    from .preemption import resolve_signals

    if threading.current_thread() is not threading.main_thread():
        return {}

    def relay(signum: int, frame: Any) -> None:
        for proc in context.processes:
            if proc.is_alive() and proc.pid:
                os.kill(proc.pid, signum)

    def interrupt(signum: int, frame: Any) -> None:
        assert interrupt_file is not None
        if os.path.exists(interrupt_file):
            raise KeyboardInterrupt
        atomic_write(interrupt_file, b"", mode=0o600)
        print("\ntrainstack: Ctrl-C: stopping at the next step boundary with a checkpoint (Ctrl-C again to abort).",
              file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, relay) for sig in resolve_signals(None)}
    if interrupt_file is not None and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    return previous


def _describe_exit(code: int) -> str:
    if code == 0:
        return ("the process exited with code 0 before its function returned (os._exit(0), or sys.exit() in a "
                "thread or a C extension?), so it has no result")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (killed by the kernel's OOM killer?)" if name == "SIGKILL" else ""
        return f"the process was killed by {name}{hint}"
    return f"the process exited with code {code} without a Python traceback"


def _died_while_importing(code: int) -> str:
    return (f"the worker exited with code {code} before it started: it failed while importing your script (its "
            f"traceback is printed above). A script that starts training at import time does this. HINT: "
            + MAIN_GUARD)


def _reap(context: tmp.ProcessContext) -> None:
    """Make sure no worker outlives the launch, whatever happened (e.g. KeyboardInterrupt)."""
    for proc in context.processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + GRACE_PERIOD_S
    for proc in context.processes:
        proc.join(max(deadline - time.monotonic(), 0.1))
        if proc.is_alive():
            proc.kill()
            proc.join()
