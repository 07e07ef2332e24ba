"""One worker's membership in the default process group (``ProcessGroupSession``): its rank and device taken,
the rendezvous store (hosted by the launching process, a worker, or torchrun's agent with a per-attempt prefix),
the group joined -- NCCL's required transport checked around it, a rank continued in place counted as joined --
and left cleanly: a barrier on success, the hosted store kept up until every rank has left."""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import sys
import time
from types import TracebackType

import torch
import torch.distributed as dist

from .._common import envvars as envvars
from .._common import transport as _transport
from ..errors import LaunchError
from . import fastexit, groupsockets, inplace
from . import layout as _layout
from . import ranklog as _ranklog
from .layout import WorkerContext

__all__ = ["ProcessGroupSession", "wait_for_count", "can_abort", "abort_groups"]

_EXITED_KEY = "trainstack/exited"
_GROUPS = itertools.count()  # the process groups this process made under torchrun's agent store, for their prefixes
EXIT_SETTLE_S = 0.1  # at a process's exit, after leaving its group: gloo's run-loop threads drop their last work
_settling = False  # settle_at_exit registered in this process


def _timeout(seconds: float | None = None) -> datetime.timedelta:
    """Collective/rendezvous timeout: ``seconds`` when the program chose it (Accelerate's InitProcessGroupKwargs),
    else ``TRAINSTACK_TIMEOUT_S``, else 30 minutes."""
    if seconds is not None:
        return datetime.timedelta(seconds=seconds)
    try:
        seconds = envvars.positive_number(envvars.TIMEOUT_S, 1800.0)
    except ValueError as exc:
        raise LaunchError(f"{exc} (seconds). HINT: unset it for the 30-minute default.") from None
    return datetime.timedelta(seconds=seconds)


class ProcessGroupSession:
    """``with ProcessGroupSession(ctx, backend): ...`` joins the default process group as ``ctx`` and leaves it.

    On a clean exit every rank passes a barrier before the group is destroyed, so nobody tears down while a peer
    is still in a collective; the rank hosting the store keeps it up until all ranks have left.
    """

    def __init__(self, ctx: WorkerContext, backend: str, host_store: bool = False,
                 timeout_s: float | None = None) -> None:
        self.ctx = ctx
        self.backend = backend
        self.host_store = host_store
        self.timeout_s = timeout_s
        self.store: dist.TCPStore | None = None

    @property
    def pg_backend(self) -> str:
        """NCCL for CUDA tensors plus gloo for CPU ones: stop flags and object collectives never touch the GPU."""
        return "cpu:gloo,cuda:nccl" if self.backend == "nccl" else self.backend

    def __enter__(self) -> ProcessGroupSession:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        # a graceful stop (SystemExit 0) is a clean exit too: every rank saved and stops together
        self.stop(ok=kind is None or (isinstance(exc, SystemExit) and not exc.code))

    def start(self) -> None:
        settle_at_exit()
        ctx = self.ctx
        _layout.activate(ctx)
        _ranklog.tee_rank_output(ctx.rank)
        device_id = None
        if ctx.device.startswith("cuda"):
            device_id = torch.device(ctx.device)
            torch.cuda.set_device(device_id)
        if ctx.world_size == 1 or dist.is_initialized():
            return
        timeout = _timeout(self.timeout_s)
        if ctx.environment == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent hosts the store and keeps it across worker restarts (same MASTER_PORT), so the
            # keys of the previous attempt's group are still there; with torch 2.13 a restarted gloo group then
            # fails in connectFullMesh about 2 times in 3. A per-attempt key prefix keeps attempts apart.
            # Each group of this process (a second fit() in the same worker) gets its own prefix as well: the
            # first group's keys would otherwise connect the second one's ranks to a group that no longer exists.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            agent_store = dist.TCPStore(ctx.master_addr, ctx.master_port, is_master=False, timeout=timeout)
            store: dist.Store = dist.PrefixStore(f"trainstack/attempt_{attempt}/group_{next(_GROUPS)}", agent_store)
        else:
            self.store = dist.TCPStore(ctx.master_addr, ctx.master_port, is_master=self.host_store,
                                       timeout=timeout, wait_for_workers=False)
            store = dist.PrefixStore("pg", self.store)
        # a required NCCL transport (--nccl-transport): this host is checked before NCCL starts, and NCCL's own
        # init lines (eager with device_id) must show that network -- a silent fallback to TCP is an error
        required = _transport.check_before_init() if self.backend == "nccl" else None
        try:
            with groupsockets.opening(ctx.master_port, gloo=self.backend == "gloo"):  # shut down if left failed
                dist.init_process_group(self.pg_backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                                        timeout=timeout, device_id=device_id)
        except Exception as exc:
            if required:
                _transport.confirm_after_init(required, error=exc)
            raise
        if required:
            _transport.confirm_after_init(required)
        inplace.joined()  # a rank continued in place: the driver counts its step as started
        fastexit.arm(ctx.rank)  # after torch's own hook (init_process_group's): a failed rank skips the teardown

    def start_for_process(self) -> None:
        """Join for the rest of the process and leave cleanly at its exit: a group left to the interpreter's
        teardown can abort a finished rank ("terminate called without an active exception", exit 134)."""
        settle_at_exit()  # first: atexit runs it after the leave registered next
        atexit.register(self.stop, True, False)
        self.start()

    def stop(self, ok: bool, barrier: bool = True) -> None:
        """Leave the group. After success, a barrier first so no rank tears down mid-collective (``barrier=False``
        at interpreter exit: a rank that died must not hold the others there for the collective timeout)."""
        try:
            if dist.is_initialized():
                if ok and barrier:
                    dist.barrier()
                if ok or self.backend != "nccl":
                    dist.destroy_process_group()
                else:  # a failed NCCL group: a destroy may wait on the lost peer forever
                    how = abort_groups()
                    print(f"trainstack: rank {self.ctx.rank} left its failed NCCL group: communicators aborted "
                          f"({how})", file=sys.stderr, flush=True)
            if ok:
                groupsockets.forget()
            else:  # its connections closed now, not when nothing holds the groups: a peer blocked on this rank fails
                groupsockets.shut()
            if self.store is not None and ok:
                self.store.add(_EXITED_KEY, 1)
                if self.host_store:
                    wait_for_count(self.store, self.ctx.world_size)
        finally:
            self.store = None
            _layout.deactivate()


def settle_at_exit() -> None:
    """Once per process that forms a group: at its exit, the last thing before the interpreter finalizes, let go of
    the GIL for ``EXIT_SETTLE_S``. Gloo's run-loop thread destroys a finished collective's work object after the
    caller's wait returned, and that destructor takes the GIL (the work captured Python state); taken once the
    interpreter is finalizing, it aborts the finished process (SIGABRT: a completed job read as crashed, seen under
    load in about 1 run in 12). Torch keeps the group's threads to the process's end, so they cannot be joined; the
    pause lets a late one finish while the interpreter lives. (Spawned workers end with ``os._exit``: no atexit.)"""
    global _settling
    if not _settling:
        _settling = True
        atexit.register(_settle)


def _settle() -> None:
    deadline = time.monotonic() + EXIT_SETTLE_S
    while time.monotonic() < deadline:
        time.sleep(0.01)


def can_abort(backend: str) -> bool:
    """Can a rank leave a failed group of ``backend`` and join another in its process: gloo's destroy never waits
    on a lost peer; NCCL's communicators need an abort -- torch's ``_abort_process_group`` (2.5 and later, all
    groups at once, inside one NCCL group call so they never deadlock each other), else each group's ``abort``."""
    if backend == "gloo":
        return True
    c10d = dist.distributed_c10d
    return backend == "nccl" and (hasattr(c10d, "_abort_process_group") or hasattr(dist.ProcessGroup, "abort"))


def abort_groups() -> str:
    """Abort every process group of this process and forget them (a new ``init_process_group`` may follow); which
    way it went, for the rank's log."""
    c10d = dist.distributed_c10d
    if hasattr(c10d, "_abort_process_group"):
        c10d._abort_process_group()  # torch's own: every group, the world forgotten
        return "torch.distributed's _abort_process_group"
    for group in list(c10d._world.pg_map):
        group.abort()
    dist.destroy_process_group()
    return "each group's abort, then destroy_process_group"


def wait_for_count(store: dist.Store, expected: int, limit_s: float = 60.0) -> None:
    """Keep a hosted store alive until ``expected`` ranks have left (bounded, never a hang)."""
    deadline = time.monotonic() + limit_s
    while store.add(_EXITED_KEY, 0) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
