"""The allocation driver's warm standbys (the process: ``_runtime/standby.py``): on each usable node, interpreters
that have imported torch and trainstack and wait to become a rank, so a rank that must start afresh -- a crash's
replacement, a spare's ranks, a whole step relaunched -- skips its interpreter's start. Torch-free.

Each standby is a one-task job step of its own (``--overlap``, named ``trainstack-standby-<host>-<n>``: a failed
training step's teardown keeps the idle ones). They start ``SETTLE_S`` after a step starts (never beside a step's
own imports) -- ``TRAINSTACK_STANDBY`` per node (default: 1 where ranks train under srun, enough for a crash's
replacement; a whole node's ranks on an idle spare, for a lost node's, and on every node under torchrun, whose
recoveries relaunch the whole step: its standbys take torchrun's worker variables) -- and a used one is replaced
the same way. The driver orders one only once it said it is ready; too few ready on the node: the ranks start
afresh, said. A standby that ends before it is ready twice on a node is not started there again, said. Off with
``TRAINSTACK_STANDBY=0``.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .._common import envvars as envvars
from .._common.jobfiles import OFFERED, JobFiles, Ready

__all__ = ["Standbys", "Taken", "SETTLE_S", "wanted"]

#: After a job step starts, how long before a standby starts beside it (its imports never slow the step's own).
SETTLE_S = 5.0
#: How long an ordered standby has to say it took its order (it looks every 20 ms) before its rank starts afresh.
TAKE_S = 2.0
#: Standbys that end before they are ready this many times on a node: none is started there again.
BROKEN_LIMIT = 2


def wanted(env: Mapping[str, str], warn: Callable[[str], None]) -> int | None:
    """Standbys per node as the job's environment asks (``TRAINSTACK_STANDBY``: a count, 0 off; unset: the
    default, None); a value that is not a count is said, and off."""
    raw = env.get(envvars.STANDBY, "").strip().lower()
    if not raw:
        return None
    if raw in ("off", "no", "false"):
        return 0
    if raw.isdigit() and int(raw) <= 64:
        return int(raw)
    warn(f"{envvars.STANDBY}={raw!r} is not a count of standbys per node (0-64; 0 turns them off): standbys are off")
    return 0


@dataclass
class _Standby:
    name: str
    host: str
    proc: subprocess.Popen[bytes]


@dataclass(frozen=True)
class Taken:
    """Ranks the driver handed to standbys (rank -> the standby: its host, pid, ready since), and their sruns."""

    ranks: dict[int, Ready]
    procs: dict[int, subprocess.Popen[bytes]]
    names: dict[int, str]


class Standbys:
    """The allocation's standbys. ``launch(host, name)`` starts one (an srun of the step command's); ``count``
    per node where ranks train (0: none), at least ``per_node`` on an idle node; ``say(line, error)`` the job's
    log, ``record(kind, hosts, **fields)`` its timeline."""

    def __init__(self, files: JobFiles, launch: Callable[[str, str], subprocess.Popen[bytes]], count: int,
                 per_node: int, say: Callable[[str, bool], None], record: Callable[..., None]) -> None:
        self.files, self._launch, self.say, self.record = files, launch, say, record
        self.enabled = count > 0
        self.count, self.per_node = count, per_node
        self.idle: dict[str, _Standby] = {}
        self.broken: dict[str, int] = {}
        self.started_any = False  # standbys were started: a step short of ready ones says so
        self.settle_until = 0.0
        self.serial = int(time.time()) % 100_000 * 1000  # names never repeat an earlier driver's

    def names(self) -> set[str]:
        """The idle standbys' step names: a failed step's teardown keeps them."""
        return set(self.idle)

    def step_started(self, now: float) -> None:
        """A job step was launched: no standby starts beside its own start."""
        self.settle_until = now + SETTLE_S

    def tend(self, usable: list[str], training: list[str], now: float) -> None:
        """Forget the standbys that ended (one that was never ready counts against its node) or whose node is no
        longer usable; once the step has settled, start the missing ones on each usable node."""
        for name, sb in list(self.idle.items()):
            if sb.proc.poll() is not None or sb.host not in usable:
                del self.idle[name]
                if sb.proc.poll() is None:
                    sb.proc.kill()
                elif name not in self.files.standby.ready_ones():
                    self._broke(sb)
        if not self.enabled or now < self.settle_until:
            return
        self.started_any = True
        for host in usable:
            want = self.count if host in training else max(self.count, self.per_node)
            have = sum(1 for sb in self.idle.values() if sb.host == host)
            for _ in range(want - have if self.broken.get(host, 0) < BROKEN_LIMIT else 0):
                self.serial += 1
                name = f"trainstack-standby-{host}-{self.serial}"
                self.idle[name] = _Standby(name, host, self._launch(host, name))

    def take(self, placement: Mapping[str, list[int]], step: int, env: Mapping[str, str], per_node: int,
             world: int) -> Taken | None:
        """Hand the ranks of job step ``step`` that ``placement`` puts on each host to that host's ready standbys
        (``env``: the step's; each takes its rendezvous, counters and sizes, and its rank of ``world``); None, said,
        when too few are ready on a host (then every rank starts afresh)."""
        placement = {h: r for h, r in placement.items() if r}
        if not self.enabled or not placement or not self.started_any:
            return None
        ready = self.files.standby.ready_ones()
        chosen: dict[str, list[_Standby]] = {}
        for host, ranks in placement.items():
            here = [sb for sb in self.idle.values() if sb.name in ready and ready[sb.name].host == host
                    and sb.proc.poll() is None]
            if len(here) < len(ranks):
                self.say(f"{len(here)} warm standby(s) ready on {host} for its {len(ranks)} rank(s): the step's "
                         f"ranks start afresh", False)
                return None
            chosen[host] = here[:len(ranks)]
        offered = {**{k: str(v) for k, v in env.items() if k in OFFERED}, envvars.NPROCS: str(world)}
        taken = Taken({}, {}, {})
        for host, ranks in placement.items():
            for rank, sb in zip(ranks, chosen[host], strict=True):
                self.files.standby.order(sb.name, step, offered, rank, per_node)
                taken.ranks[rank], taken.procs[rank], taken.names[rank] = ready[sb.name], sb.proc, sb.name
                del self.idle[sb.name]
        return taken

    def start(self, placement: Mapping[str, list[int]], step: int, env: Mapping[str, str], per_node: int,
              world: int, afresh: Callable[[tuple[str, list[int]]], subprocess.Popen[bytes]]) \
            -> list[subprocess.Popen[bytes]] | None:
        """The sruns of the ranks ``placement`` starts, handed to the ready standbys on their hosts (said and
        recorded: which process took which rank) -- a standby that does not take its order has its ranks started
        by ``afresh((host, ranks))``, said; None where too few are ready (every rank starts afresh)."""
        taken = self.take(placement, step, env, per_node, world)
        if taken is None:
            return None
        silent = self.silent(taken)
        pids = {str(rank): ready.pid for rank, ready in sorted(taken.ranks.items()) if rank not in silent}
        if pids:
            self.say(f"rank(s) {', '.join(pids)} start in warm standby process(es) "
                     f"{', '.join(map(str, pids.values()))} on {','.join(placement)}", False)
            self.record("standby_taken", list(placement), ranks=pids,
                        ready_since=min(taken.ranks[int(r)].since for r in pids))
        procs = [p for rank, p in taken.procs.items() if rank not in silent]
        for host, ranks in ((h, [r for r in silent if r in placement[h]]) for h in placement):
            if ranks:
                self.say(f"the warm standby(s) ordered to be rank(s) {', '.join(map(str, ranks))} on {host} did "
                         f"not take the order within {TAKE_S:g} s: starting them afresh", True)
                procs.append(afresh((host, ranks)))
        return procs

    def silent(self, taken: Taken) -> list[int]:
        """The ranks of ``taken`` whose standby did not say it took its order within ``TAKE_S`` (killed or stuck
        since it said it was ready); their sruns are killed -- those ranks start afresh."""
        deadline = time.monotonic() + TAKE_S
        waiting = dict(taken.names)
        while waiting and time.monotonic() < deadline:
            waiting = {r: n for r, n in waiting.items() if not self.files.standby.has_taken(n)}
            if waiting:
                time.sleep(0.01)
        for rank in waiting:
            taken.procs[rank].kill()
        return sorted(waiting)

    def stop(self) -> None:
        """Kill every idle standby (the job ends; a standby also leaves by itself once the driver ended)."""
        for sb in self.idle.values():
            sb.proc.kill()
        for sb in self.idle.values():
            sb.proc.wait()
        self.idle.clear()

    def _broke(self, sb: _Standby) -> None:
        self.broken[sb.host] = self.broken.get(sb.host, 0) + 1
        stop = self.broken[sb.host] >= BROKEN_LIMIT
        self.say(f"a warm standby on {sb.host} ended before it was ready (exit status {sb.proc.returncode})"
                 + ("; no more standbys on that node: its ranks start afresh" if stop else ": starting another"), False)
