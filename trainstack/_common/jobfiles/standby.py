"""The driver <-> standby protocol: a warm interpreter on a node of the allocation says it is ready
(``standby/<name>.ready``: "HOST PID"), the driver orders it to run one rank of a job step (``standby/<name>.json``:
checked as an ``Offer`` for exactly one rank, nothing else is taken from it), and the standby, now that rank, names
its rank for its task's wrapper (``steps/<host>-<wrapper pid>.rank``) so a failure is recorded as that rank's.
Torch-free, stdlib only."""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from ..files import SMALL, UnreadableFile, atomic_write, pass_over, read_back
from .base import Folder
from .step import Offer

__all__ = ["StandbyRecords", "Ready", "STANDBY_NAME"]

#: A standby's name: its Slurm step's name too (``--job-name``), so the driver keeps the idle ones alive.
STANDBY_NAME = re.compile(r"^trainstack-standby-[A-Za-z0-9_.-]{1,200}-[0-9]{1,9}$")


class Ready(NamedTuple):
    """A standby that said it is ready: where, its pid, since when (its record's time)."""

    host: str
    pid: int
    since: float


class StandbyRecords(Folder):
    """The standbys' records (``JobFiles.standby``)."""

    STANDBY = "standby"

    def clear(self) -> None:
        """At a driver's start: no standby of an earlier attempt or driver is ready, and no order of theirs waits."""
        import shutil

        if self.path(self.STANDBY).is_symlink():
            self.path(self.STANDBY).unlink()
        shutil.rmtree(self.path(self.STANDBY), ignore_errors=True)

    def ready(self, name: str, host: str, pid: int) -> None:
        """Standby ``name`` has imported what a rank needs and waits for an order (written by the standby)."""
        self._check(name)
        atomic_write(self._sub(self.STANDBY) / f"{name}.ready", f"{host} {pid}\n")

    def ready_ones(self) -> dict[str, Ready]:
        """The standbys that said they are ready, by name. Only the owner's records count."""
        found = {}
        for path in self._files_in(self.STANDBY, "*.ready"):
            name = path.name[:-len(".ready")]
            parts, since = self._read(path).split(), self._mtime(path)
            if STANDBY_NAME.match(name) and len(parts) == 2 and parts[1].isdigit() and len(parts[1]) < 10 and since:
                found[name] = Ready(parts[0], int(parts[1]), since)
        return found

    def order(self, name: str, step: int, env: dict[str, str], rank: int, per_node: int) -> None:
        """Tell standby ``name`` to run ``rank`` of job step ``step`` (its rendezvous, counters and sizes from
        ``env``, as an offer's); written whole, and checked as the standby will read it."""
        self._check(name)
        data = {"step": step, "env": env, "ranks": [rank], "per_node": per_node}
        Offer.parse(data, step)
        atomic_write(self._sub(self.STANDBY) / f"{name}.json", json.dumps(data))

    def order_for(self, name: str) -> Offer | None:
        """The driver's order to standby ``name`` (one rank), checked; None (yet), or passed over with a line when
        it is not the driver's (someone else's file, not JSON, not an order of one rank)."""
        path = self.path(self.STANDBY) / f"{name}.json"
        try:
            data = json.loads(read_back(path, SMALL, self.uid))
            step = data.get("step") if isinstance(data, dict) else None
            offer = Offer.parse(data, step if type(step) is int else -1)
            if len(offer.ranks) != 1:
                raise ValueError(f"names {len(offer.ranks)} ranks, not one")
            return offer
        except FileNotFoundError:
            return None
        except UnreadableFile as exc:
            pass_over(exc, "a standby's order")
        except json.JSONDecodeError:
            pass_over(UnreadableFile(path, "is not JSON: not an order of the driver's"), "a standby's order")
        except ValueError as exc:
            pass_over(UnreadableFile(path, f"is not an order of the driver's: {exc}"), "a standby's order")
        return None

    def took(self, name: str) -> None:
        """Standby ``name`` took its order (written by the standby before anything else)."""
        self._check(name)
        atomic_write(self._sub(self.STANDBY) / f"{name}.took", "")

    def has_taken(self, name: str) -> bool:
        """Did standby ``name`` say it took its order?"""
        return self._present(self.path(self.STANDBY) / f"{name}.took")

    def note_rank(self, host: str, wrapper_pid: int, rank: int) -> None:
        """A standby became ``rank``: its task's wrapper records a failure as this rank's."""
        atomic_write(self._sub(self.STEPS) / f"{host}-{wrapper_pid}.rank", str(rank))

    @staticmethod
    def _check(name: str) -> None:
        if not STANDBY_NAME.match(name):
            raise ValueError(f"{name!r} is not a standby's name (trainstack-standby-HOST-N)")
