"""The driver <-> rank protocol of one job step, and the whole contract of a restart in place: a failing task's
exit record (``exits/``), a rank that lost a peer (``peers-lost/``: waiting in place or leaving), the driver's offer
of the next step to the waiting ranks (``rejoin/step-<n>.json``: only its rendezvous and counters, checked as
``Offer``) and their answer that they joined it, the job step a rank restarted in place is in (``steps/``), the
nodes that did not answer (``lost``). Torch-free, stdlib only."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from .. import envvars as envvars
from ..files import SMALL, UnreadableFile, atomic_write, pass_over, read_back
from .base import Folder
from .names import OFFERED

__all__ = ["StepRecords", "Exit", "Offer"]

_HOST = re.compile(r"^[A-Za-z0-9_.:-]{1,253}$")
_MAX_RANKS = 1 << 20


@dataclass(frozen=True)
class Offer:
    """The driver's next job step for the ranks waiting in place (``rejoin/step-<n>.json``), checked: ``env`` holds
    only ``OFFERED`` names with values of their type."""

    step: int
    env: dict[str, str] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    per_node: int = 1

    @property
    def where(self) -> str:
        return f"{self.env.get('MASTER_ADDR', '?')}:{self.env.get('MASTER_PORT', '?')}"

    @classmethod
    def parse(cls, data: object, named_step: int) -> Offer:
        """The offer in ``data`` (decoded JSON of the file named for step ``named_step``), or ValueError naming what
        is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"is not a JSON object but {type(data).__name__}")
        step, ranks, per_node, env = data.get("step"), data.get("ranks"), data.get("per_node"), data.get("env")
        if type(step) is not int or step != named_step:
            raise ValueError(f"names step {step!r}, not the step {named_step} of its name")
        if not isinstance(ranks, list) or not ranks or len(ranks) > _MAX_RANKS or \
                any(type(r) is not int or not 0 <= r < _MAX_RANKS for r in ranks):
            raise ValueError(f"'ranks' must be a list of ranks (non-negative integers), not {str(ranks)[:80]!r}")
        if type(per_node) is not int or not 1 <= per_node <= 4096:
            raise ValueError(f"'per_node' must be an integer from 1 to 4096, not {per_node!r}")
        if not isinstance(env, dict):
            raise ValueError(f"'env' must be an object, not {type(env).__name__}")
        extra = sorted(str(k) for k in env if k not in OFFERED)
        if extra:
            raise ValueError(f"'env' sets {', '.join(extra)[:200]}, which an offer never sets (only "
                             f"{', '.join(OFFERED)})")
        for key, value in env.items():
            if not isinstance(value, str) or not value or "\0" in value or len(value) > 255:
                raise ValueError(f"'env' {key} must be a short string, not {str(value)[:80]!r}")
            if key == "MASTER_ADDR" and not _HOST.match(value):
                raise ValueError(f"'env' MASTER_ADDR {value[:80]!r} is not a host name")
            if key != "MASTER_ADDR" and not (value.isdigit() and len(value) < 10):
                raise ValueError(f"'env' {key} must be a number, not {value[:80]!r}")
        if not 0 < int(env.get("MASTER_PORT", "1")) < 65536:
            raise ValueError(f"'env' MASTER_PORT {env['MASTER_PORT']} is not a port")
        if env.get(envvars.STEP, str(step)) != str(step):
            raise ValueError(f"'env' {envvars.STEP} {env[envvars.STEP]} is not its step {step}")
        return cls(step, dict(env), tuple(ranks), per_node)


@dataclass(frozen=True)
class Exit:
    """A task that ended with an error status, as its wrapper recorded it (``exits/<unit>``)."""

    time: float
    code: int
    unit: str  # rank-<r> (one task per rank: srun) or node-<n> (one task per node: torchrun, spawn, custom)
    host: str
    step: int | None = None  # the job step (TRAINSTACK_STEP) it belonged to; None in a record without one

    @property
    def rank(self) -> int | None:
        return int(self.unit[5:]) if self.unit.startswith("rank-") and self.unit[5:].isdigit() else None

    @property
    def where(self) -> str:
        return f"rank {self.rank} ({self.host})" if self.rank is not None else f"the task on {self.host}"


@dataclass(frozen=True)
class StepRecords(Folder):
    """One job step's records: what the driver and the ranks tell each other (``JobFiles.step``)."""

    def clear(self) -> None:
        """Before a job step: no exit record, lost node or next-step offer of the one before (this step's offer is
        written after)."""
        import shutil

        for name in (self.EXITS, self.PEERS_LOST, self.REJOIN):  # a requeued job counts its steps from 0 again
            if self.path(name).is_symlink():
                self.path(name).unlink()
            shutil.rmtree(self.path(name), ignore_errors=True)
        self.path(self.LOST).unlink(missing_ok=True)

    def exits(self, step: int | None = None) -> list[Exit]:
        """The failing tasks of job step ``step`` (None: of the newest step any record names), first first. A task
        of the step before that dies after the next one started (its remains are killed, not waited for) records
        its step, so it never reads as the new step's failure."""
        found = []
        for path in self._files_in(self.EXITS, "[!.]*"):
            parts = self._read(path).split()
            try:
                found.append(Exit(float(parts[0]), int(parts[1]), parts[2], parts[3],
                                  int(parts[4]) if len(parts) > 4 else None))
            except (IndexError, ValueError, OverflowError):
                continue
        if step is None:
            step = max((x.step for x in found if x.step is not None), default=None)
        return sorted((x for x in found if x.step is None or step is None or x.step == step), key=lambda x: x.time)

    def has_exits(self, step: int | None = None) -> bool:
        return bool(self.exits(step))

    def peer_lost(self, rank: int, host: str, step: int, waiting: bool = False) -> None:
        """This rank's collective failed because a peer is gone (it waits, asleep, before it leaves; ``waiting``: it
        waits in place for the next step, ``rejoin_offer``): the driver's detection of the failure without waiting
        for an exit (``fastexit``). One write; never raises."""
        try:
            mark = " waiting" if waiting else ""
            atomic_write(self._sub(self.PEERS_LOST) / f"rank-{rank}", f"{time.time():.3f} {step} {host}{mark}\n")
        except OSError:
            pass

    def waiting(self, step: int) -> dict[int, str]:
        """The ranks of job step ``step`` waiting in place for the next step, each with its host."""
        found = {}
        for path in self._files_in(self.PEERS_LOST, "rank-*"):
            parts = self._read(path).split()
            if len(parts) > 3 and parts[3] == "waiting" and parts[1] == str(step) and path.name[5:].isdigit():
                found[int(path.name[5:])] = parts[2]
        return found

    def offer(self, step: int, env: dict[str, str], ranks: list[int], per_node: int) -> None:
        """The next job step ``step``, for the ``ranks`` waiting in place (each keeps its rank; ``per_node`` ranks
        per node): the environment they take (rendezvous, counters, sizes) before they join its process group;
        written whole (a reader never sees half of it)."""
        offered = {k: str(v) for k, v in env.items() if k in OFFERED}
        Offer.parse({"step": step, "env": offered, "ranks": ranks, "per_node": per_node}, step)  # as it is read
        atomic_write(self._sub(self.REJOIN) / f"step-{step}.json",
                     json.dumps({"step": step, "env": offered, "ranks": ranks, "per_node": per_node}))

    def offer_after(self, after: int) -> Offer | None:
        """The newest next-step offer for a step after ``after``, or None (yet): only the owner's, checked
        (``Offer.parse``); one that is not is passed over with a line naming it."""
        steps = {int(p.name[5:-5]): p for p in self._files_in(self.REJOIN, "step-*.json")
                 if p.name[5:-5].isdigit() and len(p.name) < 20}
        for n in sorted((n for n in steps if n > after), reverse=True):
            try:
                return Offer.parse(json.loads(read_back(steps[n], SMALL, self.uid)), n)
            except FileNotFoundError:
                continue
            except UnreadableFile as exc:
                pass_over(exc, "an offer")
            except json.JSONDecodeError:
                pass_over(UnreadableFile(steps[n], "is not JSON: not an offer of the driver's"), "an offer")
            except ValueError as exc:
                pass_over(UnreadableFile(steps[n], f"is not an offer of the driver's: {exc}"), "an offer")
        return None

    def joined(self, rank: int, step: int) -> None:
        """A rank that waited in place joined job step ``step``'s process group (the driver counts the step as
        started with it only then). Never raises."""
        try:
            atomic_write(self._sub(self.REJOIN) / f"joined-{step}-rank-{rank}", f"{time.time():.3f}\n")
        except OSError:
            pass

    def joined_ranks(self, step: int) -> set[int]:
        """The waiting ranks that joined job step ``step``."""
        prefix = f"joined-{step}-rank-"
        return {int(p.name[len(prefix):]) for p in self._files_in(self.REJOIN, f"{prefix}*")
                if p.name[len(prefix):].isdigit() and self._present(p)}

    def note_step(self, host: str, wrapper_pid: int, step: int) -> None:
        """A rank restarted in place is now in job step ``step``: its task's wrapper records a failure under it."""
        atomic_write(self._sub(self.STEPS) / f"{host}-{wrapper_pid}", str(step))

    def peers_lost(self, step: int | None = None) -> list[float]:
        """When the ranks of job step ``step`` (None: any) that lost a peer said so, first first."""
        return sorted(when for when, _, _ in self._peer_signs(step))

    def peer_hosts(self, step: int | None = None) -> dict[str, float]:
        """The hosts with a rank of job step ``step`` that lost a peer, each with its first such rank's time."""
        hosts: dict[str, float] = {}
        for when, host, _ in self._peer_signs(step):
            hosts[host] = min(when, hosts.get(host, when))
        return hosts

    def accounted(self, step: int) -> set[int]:
        """The ranks of job step ``step`` known to be out of training: an exit recorded (one task per rank) or a
        peer lost."""
        return {x.rank for x in self.exits(step) if x.rank is not None} | {r for _, _, r in self._peer_signs(step)}

    def hosts_out(self, step: int, ranks_per_host: int) -> set[str]:
        """The hosts of job step ``step`` (one task per node: torchrun, spawn) known to be out of training: their task
        recorded its exit, or ``ranks_per_host`` of their ranks said they lost a peer."""
        lost: dict[str, set[int]] = {}
        for _, host, rank in self._peer_signs(step):
            lost.setdefault(host, set()).add(rank)
        return {x.host for x in self.exits(step)} | {h for h, ranks in lost.items() if len(ranks) >= ranks_per_host}

    def _peer_signs(self, step: int | None) -> list[tuple[float, str, int]]:
        found = []
        for path in self._files_in(self.PEERS_LOST, "rank-*"):
            parts = self._read(path).split()
            try:
                if step is None or int(parts[1]) == step:
                    found.append((float(parts[0]), parts[2] if len(parts) > 2 else "", int(path.name[5:])))
            except (IndexError, ValueError, OverflowError):
                continue
        return found

    def first_sign(self, step: int | None = None) -> float | None:
        """When the step's failure first showed: a failing task's exit, or a rank that lost its peer if that was
        earlier (a node lost whole leaves no exit; a torchrun agent records its killed worker ~1 s late)."""
        exits = self.exits(step)
        if step is None and exits:
            step = exits[0].step
        times = [x.time for x in exits[:1]] + self.peers_lost(step)[:1]
        return min(times) if times else None

    def write_lost(self, hosts: dict[str, list[int]]) -> None:
        """The hosts that did not answer after the step failed, with the ranks each ran."""
        text = "".join(f"{host} {','.join(map(str, ranks))}\n" for host, ranks in hosts.items())
        atomic_write(self.path(self.LOST), text)

    def lost(self) -> list[tuple[str, list[str]]]:
        rows = [line.split() for line in self._read(self.path(self.LOST)).splitlines() if line.strip()]
        return [(row[0], row[1].split(",") if len(row) > 1 else []) for row in rows]
