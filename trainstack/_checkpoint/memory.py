"""Memory checkpoints: every rank's full resume state every N steps in node-local memory (``/dev/shm``), with a copy
on a rank of another node -- a restart loses seconds of work, not everything since the last durable checkpoint.

    /dev/shm/trainstack-<uid>/                                  0700, this user's (refused otherwise)
        job-<SLURM_JOB_ID or "local">-<run folder hash>/<node>/
            r00002-s000000040.pt      rank 2's state at step 40 (its own copy, or the copy it sent this node)
            r00002-s000000040.json    the manifest, written last: owner, step, world size, bytes, sha256, run id

A save copies the state to CPU memory on the training thread (the stall), then a thread of its own serializes it,
writes it here and swaps copies with the peer over a gloo group of its own; once every rank holds both copies of
step S, older sets are removed: at most the set being written and the newest complete one. A restart's ranks agree
on the newest step that every rank has a verified copy of -- its own, else one another rank holds, sent over --
newer than the durable checkpoint; never a mixed set. Every copy carries its run's id (``run.json``): a set of
another run in the same path -- a run folder deleted and started again -- is never restored; it is removed, said.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import queue
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._common import envvars as envvars
from .._common.files import untrusted_folder
from .._common.jobfiles import JobFiles
from ..errors import ConfigError
from .memformat import is_dtensor, packed, staged, unpacked, unstaged
from .memnode import Found, Node, read_copy
from .parts import Restored, load_parts, state_of
from .rng import capture_rng

__all__ = ["MemoryCheckpoints", "restore_memory", "Found", "memory_root", "node_name", "staged", "unstaged"]

log = logging.getLogger(__name__)

_SETS = 2  # the set being written and the newest complete one


def memory_root() -> Path:
    """Where memory checkpoints live: ``$TRAINSTACK_MEMORY_DIR`` (default ``/dev/shm``) / ``trainstack-<uid>``."""
    return Path(os.environ.get(envvars.MEMORY_DIR) or "/dev/shm") / f"trainstack-{os.getuid()}"


def node_name() -> str:
    """The node this process runs on, as memory checkpoints name it (``TRAINSTACK_NODE_NAME`` wins: tests and
    containers whose hostname is not the node's)."""
    return os.environ.get(envvars.NODE_NAME) or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _job_key(run_folder: Path) -> str:
    job = os.environ.get("SLURM_JOB_ID") or "local"
    digest = hashlib.sha1(str(Path(run_folder).resolve()).encode()).hexdigest()[:10]
    return f"job-{job}-{digest}"


class MemoryCheckpoints:
    """One rank's memory checkpoints for one run: ``open`` (collective: the peer, the space check), ``save`` every N
    steps (the stall: a CPU copy), ``restore`` at a start (collective), ``close``."""

    def __init__(self, folder: Path, node: str, rank: int, world: int, group: Any, peers: list[int | None],
                 nodes: list[str], format_version: int = 1, run: str = "") -> None:
        self.format_version = format_version
        self.folder, self.node, self.rank, self.world, self.group = folder, node, rank, world, group
        self.peers = peers  # per rank: the rank on another node that keeps its copy (None: one node only)
        self.nodes = nodes  # per rank: its node
        self.peer = peers[rank]
        self.senders = [r for r, p in enumerate(peers) if p == rank and r != rank]
        self.files = Node(folder / node, rank, run)
        self.stale_removed: list[str] = []  # what open removed of another run in this path, in words (rank 0)
        self.waited_seconds = 0.0  # training waited for the previous save (the interval was shorter than a round)
        self.staging: list[float] = []  # each save's CPU copy, in seconds (the first also maps the buffers)
        self._buffers: dict[str, torch.Tensor] = {}  # the staging copies, reused from save to save
        self.saves = 0
        self.error: str = ""  # why the last save failed on this rank ('' when it did not)
        self.rounds = 0  # saves every rank finished (written and copied, or failed)
        self.failed_rounds = 0  # of them, those that left no complete set (a full /dev/shm, a dead peer)
        self.newest_complete: int | None = None  # the step of the newest complete set of this run
        self.failing = False  # the last round failed (the newest set is older than the last save)
        self.say: Callable[[str], None] | None = None  # rank 0: the run's console, for failures and recoveries
        self.last_passed_over: list[str] = []  # the copies the last restore refused, in words
        self._queue: queue.Queue[tuple[int, Any] | None] = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, run_folder: Path, rank: int, world: int, state_bytes: int, format_version: int = 1, run: str = ""
             ) -> MemoryCheckpoints:
        """Collective: the folder (private, refused otherwise), the peer of every rank (the same local index on the
        next node), and the space check: every node must hold two sets of its ranks' states and of the copies
        sent to it, else a ``ConfigError`` naming the node, the sizes and the fix, before training starts."""
        root = memory_root()
        problem = untrusted_folder(root)
        if problem:
            raise ConfigError(f"memory checkpoints cannot use {root}: {problem}; others could change or read the "
                              f"states in it. HINT: remove it, or set {envvars.MEMORY_DIR} to a folder only you can "
                              f"write.")
        folder = root / _job_key(run_folder)
        node = node_name()
        group = dist.new_group(backend="gloo") if world > 1 else None
        folder.mkdir(mode=0o700, exist_ok=True)
        (folder / node).mkdir(mode=0o700, exist_ok=True)
        here = Node(folder / node, rank, run)
        here.remove_temp()  # what a killed writer of this rank left
        stale = here.stale()  # another run's sets in this path: never restored, removed (every rank of the node)
        here.remove(stale)
        mine = {"node": node, "bytes": state_bytes, "free": shutil.disk_usage(folder / node).free,
                "used": here.used_bytes(), "stale": sorted({c.step for c in stale})}
        everyone = _all_gather(mine, group, world)
        nodes = [e["node"] for e in everyone]
        peers = _peers(nodes)
        _check_space(everyone, peers, root)
        memory = cls(folder, node, rank, world, group, peers, nodes, format_version, run)
        steps = sorted({s for e in everyone for s in e["stale"]})
        if steps:
            memory.stale_removed.append(f"memory checkpoints of an earlier run in this path (step "
                                        f"{', '.join(map(str, steps))}) removed from {folder}: they belong to "
                                        f"another run id than this run folder's")
        return memory

    def bind(self, run: str) -> None:
        """The run id this rank's copies carry from now on (a run that adopted the id of the checkpoint it resumed)."""
        self.files.run = run

    # -------------------------------------------------------------- saving
    def state(self, counters: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any]:
        """This rank's whole resume state (a sharded model's own shard): what a memory checkpoint stages."""
        state: dict[str, Any] = {"format_version": self.format_version, **counters}
        for name, part in parts.items():
            state[name] = state_of(part)
        if parts.get("optimizer") is not None:
            state["optimizer_class"] = type(parts["optimizer"]).__name__
        state["rng"] = capture_rng()
        return state

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Stage ``state`` (this rank's resume state at ``step``) and hand it to the writer thread; returns the
        seconds training waited (for the previous save -- ``waited_seconds`` -- and for the CPU copy)."""
        start = time.perf_counter()
        self.wait()
        staging = time.perf_counter()
        self.waited_seconds += staging - start
        copy = staged(state, self._buffers)
        if any(t.is_pinned() for t in self._buffers.values()):
            torch.cuda.synchronize()  # the non-blocking copies from the GPU have landed
        self.staging.append(time.perf_counter() - staging)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="trainstack-memory-checkpoints", daemon=True)
            self._thread.start()
        self._idle.clear()
        self._queue.put((step, copy))
        self.saves += 1
        return time.perf_counter() - start

    def wait(self) -> None:
        """Until the save in flight is written and copied."""
        self._idle.wait()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._round(*item)
            except Exception as exc:  # a dead peer, a full /dev/shm: the durable checkpoints still count
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("memory checkpoint at step %d failed on rank %d: %s", item[0], self.rank, self.error)
                self._account(item[0], False)
            finally:
                self._idle.set()

    def _account(self, step: int, complete: bool) -> None:
        """Count a round; say the first failure of a series and the recovery after it (rank 0): meanwhile a failure
        loses everything since the newest complete set, not the N steps memory checkpoints promise."""
        self.rounds += 1
        if complete:
            self.newest_complete = step
            if self.failing and self.say is not None:
                self.say(f"trainstack: memory checkpoints work again at step {step} (after {self.failed_rounds} "
                         f"failed round(s) so far).")
            self.failing = False
            return
        self.failed_rounds += 1
        if not self.failing and self.say is not None:
            since = f"step {self.newest_complete}" if self.newest_complete is not None else "none yet"
            self.say(f"trainstack: WARNING: the memory checkpoint of step {step} failed "
                     f"({self.error or 'on another rank'}); the newest complete set is {since}, so a failure now "
                     f"loses more than the usual steps (the durable checkpoints still count). Said again when "
                     f"they work again.")
        self.failing = True

    def _round(self, step: int, copy: dict[str, Any]) -> None:
        """Write this rank's copy, swap copies with the peer, and once every rank holds both, drop older sets."""
        ok, path, sha = 1, None, ""
        try:
            path, sha = self.files.write(self.rank, step, self.world, packed(copy))
        except OSError as exc:
            ok, self.error = 0, f"cannot write {self.files.folder}: {exc.strerror or exc}"
        for sender, (data, digest) in self._swap(path, sha).items():
            try:
                self.files.write(sender, step, self.world, [data], digest)
            except OSError as exc:
                ok, self.error = 0, f"cannot write {self.files.folder}: {exc.strerror or exc}"
        flag = torch.tensor([ok], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        complete = int(flag.item()) == 1
        if complete:
            self.files.prune([self.rank, *self.senders], step)
        self._account(step, complete)
        if complete:
            self.error = ""

    def _swap(self, path: Path | None, sha: str) -> dict[int, tuple[memoryview, str]]:
        """Send this rank's copy (mapped from its file: no copy of the bytes) to its peer with its checksum, and
        receive the copies of the ranks whose peer it is. A rank whose own write failed sends nothing usable (size
        0): its peer keeps no copy of it this time."""
        if self.peer is None or self.group is None:
            return {}
        with contextlib.ExitStack() as stack:
            data = torch.empty(0, dtype=torch.uint8)
            if path is not None and path.stat().st_size:
                fh = stack.enter_context(open(path, "rb"))
                mapped = stack.enter_context(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY))
                data = torch.frombuffer(mapped, dtype=torch.uint8)
            head = torch.frombuffer(bytearray(data.numel().to_bytes(8, "little") + bytes.fromhex(sha or "0" * 64)),
                                    dtype=torch.uint8)
            heads = {s: torch.zeros(40, dtype=torch.uint8) for s in self.senders}
            self._exchange(head, heads)
            inbox = {s: torch.empty(int.from_bytes(bytes(t[:8].tolist()), "little"), dtype=torch.uint8)
                     for s, t in heads.items()}
            self._exchange(data, inbox)
            del data  # before the mapping closes
        return {s: (t.numpy().data, bytes(heads[s][8:].tolist()).hex()) for s, t in inbox.items() if t.numel()}

    def _exchange(self, out: torch.Tensor, inbox: dict[int, torch.Tensor]) -> None:
        works = [dist.isend(out, self.peer, group=self.group)] if self.peer is not None and out.numel() else []
        works += [dist.irecv(t, s, group=self.group) for s, t in inbox.items() if t.numel()]
        for w in works:
            if w is not None:
                w.wait()

    # -------------------------------------------------------------- restoring
    def restore(self, newer_than: int) -> Found | None:
        """Collective: the newest step after ``newer_than`` (the durable checkpoint's) that every rank has a
        verified copy of; this rank's state from it (its own copy, else one another rank holds, sent over). None
        when there is no such set (every rank then says why in ``passed_over``)."""
        mine = self.files.copies(self.world)
        inventories = _all_gather([(c.owner, c.step, c.size, c.sha256) for c in mine], self.group, self.world)
        held: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
        for holder, listing in enumerate(inventories):
            for owner, step, size, sha in listing:
                held.setdefault((owner, step), []).append((holder, size, sha))
        passed_over: list[str] = []
        steps = sorted({step for _, step in held if step > newer_than}, reverse=True)
        for step in steps:
            holders = {o: self._one_per_node(sorted(held.get((o, step), []), key=_own_first(o)))
                       for o in range(self.world)}
            while True:
                missing = [o for o, h in holders.items() if not h]
                if missing:
                    passed_over.append(f"step {step}: no copy left of rank(s) {', '.join(map(str, missing))}")
                    break
                plan = {o: h[0] for o, h in holders.items()}
                data, why = self._fetch(step, plan)
                state = None
                if not why:  # a copy that passes its checksum must still decode (a foreign or crafted header)
                    try:
                        state = unpacked(data)
                    except Exception as exc:  # noqa: BLE001 -- torch's unpickler raises several kinds
                        why = f"it passes its checksum but cannot be decoded ({type(exc).__name__})"
                verdicts = _all_gather(why, self.group, self.world)
                if not any(verdicts) and state is not None:
                    sources = ["own memory" if plan[o][0] == o else f"a copy on {self.nodes[plan[o][0]]}"
                               for o in range(self.world)]
                    self.last_passed_over = passed_over
                    return Found(state, step, self.files.folder / f"r{self.rank:05d}-s{step:09d}.pt", sources,
                                 passed_over)
                for owner, reason in enumerate(verdicts):
                    if reason:
                        holder = plan[owner][0]
                        where = "its own memory" if holder == owner else f"the copy on {self.nodes[holder]}"
                        passed_over.append(f"rank {owner}'s step {step} in {where}: {reason}")
                        holders[owner] = holders[owner][1:]
        other = [(c.step, c.world) for c in self.files.all_copies() if c.run == self.files.run
                 and c.world != self.world and c.step > newer_than]
        if other:  # a shrunk (or grown) run: a set lays out one process's state each, it does not reshard
            step, world = max(other)
            passed_over.append(f"step {step}: written by {world} processes, this run has {self.world} (a memory set "
                               f"does not reshard; the durable checkpoint does)")
        self.last_passed_over = passed_over
        return None

    def forget_after(self, step: int) -> None:
        """Remove the copies this rank wrote of steps after ``step``, where this attempt starts (every rank has read
        what it restores): an abandoned attempt went further, and its copies must not join this attempt's in a later
        set (the same bytes only where training is bitwise deterministic)."""
        owners = {self.rank, *self.senders}
        self.files.remove([c for c in self.files.copies(self.world) if c.owner in owners and c.step > step])

    def _one_per_node(self, holders: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
        """The ranks of one node see the same file: it is one copy, asked of the first of them."""
        seen: set[str] = set()
        out = []
        for holder in holders:
            if self.nodes[holder[0]] not in seen:
                seen.add(self.nodes[holder[0]])
                out.append(holder)
        return out

    def _fetch(self, step: int, plan: dict[int, tuple[int, int, str]]) -> tuple[bytearray, str]:
        """Every copy in ``plan`` to its owner (read here, or sent by its holder, in rank order); this rank's bytes
        and why they cannot be used ('' when verified)."""
        data, why = bytearray(), ""
        here = {c.owner: c for c in self.files.copies(self.world) if c.step == step}
        for owner in range(self.world):
            holder, size, sha = plan[owner]
            if holder == owner == self.rank:
                copy = here.get(owner)
                data, why = read_copy(copy) if copy is not None else (bytearray(), "gone")
            elif holder == self.rank:  # send it over, whatever it holds: the owner checks it
                copy = here.get(owner)
                payload = read_copy(copy)[0] if copy is not None else bytearray(size)
                dist.send(torch.frombuffer(payload, dtype=torch.uint8), owner, group=self.group)
            elif owner == self.rank:
                inbox = torch.empty(size, dtype=torch.uint8)
                dist.recv(inbox, holder, group=self.group)
                data = bytearray(inbox.numpy().data)
                why = "" if hashlib.sha256(data).hexdigest() == sha else "its checksum does not match"
        return data, why

    # -------------------------------------------------------------- the end
    def record_folder(self) -> None:
        """Tell the batch script (the job folder's ``memory-folders``) to free this folder on every node at the
        job's end, also when the training processes are killed."""
        job = JobFiles.current()
        if job is None or self.rank != 0:
            return
        try:
            job.memory.record(self.folder)
        except OSError:
            pass

    def close(self, finished: bool) -> None:
        """Stop the writer; a finished run frees what this rank wrote (a failed one keeps it for the restart)."""
        if self._thread is not None:
            if finished:
                self.wait()
            try:
                self._queue.put_nowait(None)  # a round in flight on a failed run is left to die with the process
            except queue.Full:
                pass
            if finished:
                self._thread.join(timeout=60)
        if finished and self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)  # not left to the interpreter's teardown (it can abort a rank)
            self.group = None
        if finished:
            for copy in self.files.copies_of([self.rank, *self.senders]):
                copy.path.with_suffix(".json").unlink(missing_ok=True)
                copy.path.unlink(missing_ok=True)
            job = JobFiles.current()
            if job is not None:  # the driver's end need not free this rank's node, nor say it could not
                try:
                    job.memory.freed_on(os.environ.get("SLURMD_NODENAME") or socket.gethostname())
                except OSError:
                    pass
            for folder in (self.files.folder, self.folder):
                try:
                    folder.rmdir()  # the last rank of the node (of the job) removes the folder
                except OSError:
                    pass


def _own_first(owner: int) -> Callable[[tuple[int, int, str]], tuple[bool, int]]:
    """Holders of a rank's copy in the order they are asked: the rank itself, then by rank."""
    return lambda holder: (holder[0] != owner, holder[0])


def _all_gather(obj: Any, group: Any, world: int) -> list[Any]:
    if world == 1 or group is None:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _peers(nodes: list[str]) -> list[int | None]:
    """Per rank, the rank that keeps its copy: the same local index on the next node (None on one node)."""
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    ranks = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out: list[int | None] = []
    for rank, node in enumerate(nodes):
        nxt = ranks[order[(order.index(node) + 1) % len(order)]]
        out.append(nxt[ranks[node].index(rank) % len(nxt)])
    return out


def _check_space(everyone: list[dict[str, Any]], peers: list[int | None], root: Path) -> None:
    """Every node holds two sets of its ranks' states and of the copies sent to it: else a clear error."""
    need: dict[str, int] = {}
    for rank, e in enumerate(everyone):
        need[e["node"]] = need.get(e["node"], 0) + _SETS * e["bytes"]
        peer = peers[rank]
        if peer is not None:
            node = everyone[peer]["node"]
            need[node] = need.get(node, 0) + _SETS * e["bytes"]
    for node, bytes_needed in need.items():
        first = next(e for e in everyone if e["node"] == node)
        room = first["free"] + first["used"]
        if bytes_needed > room:
            per_rank = max(e["bytes"] for e in everyone)
            raise ConfigError(f"memory checkpoints need {_size(bytes_needed)} in {root.parent} on node {node} (two "
                              f"sets of its ranks' states and of the copies other nodes send it; one rank's state "
                              f"is {_size(per_rank)}) but only {_size(room)} is free there. HINT: give the job a "
                              f"larger /dev/shm (docker --shm-size, the site's tmpfs limit), point "
                              f"{envvars.MEMORY_DIR} at a larger memory file system, or turn them off "
                              f"(memory_checkpoint_every_n_steps=0).")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def estimate_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """This rank's resume state, before the optimizer has any: the parameters and buffers (local shards), and the
    optimizer's per-parameter state (two tensors like each parameter for Adam-like optimizers, one for SGD with
    momentum)."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
        return t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    buffers = sum(local(b) for b in model.buffers())
    kind = type(optimizer).__name__.lower() if optimizer is not None else ""
    per_param = 0 if optimizer is None else 1 if kind == "sgd" else 2
    return params * (1 + per_param) + buffers + (1 << 16)


def restore_memory(memory: MemoryCheckpoints, parts: Mapping[str, Any], newer_than: int, world: int,
                   check: Callable[[Mapping[str, Any], Path], None] | None = None, reserved: tuple[str, ...] = ()
                   ) -> tuple[Restored | None, list[str]]:
    """Collective: load the newest complete memory set newer than step ``newer_than`` into ``parts``; the
    ``Restored`` (None: no such set) and the copies passed over, in words."""
    found = memory.restore(newer_than)
    if found is None:
        return None, list(memory.last_passed_over)
    if check is not None:
        check(found.state, found.path)
    state = found.laid_out(parts)
    load_parts(parts, state, found.path)
    counters = {k: v for k, v in state.items() if k not in reserved and k not in parts}
    return Restored(counters, state.get("rng"), found.path, world, found.source(), "memory"), found.passed_over
