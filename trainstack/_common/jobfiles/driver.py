"""The allocation driver's liveness: its heartbeat (``driver.alive``'s mtime, touched every second), where it runs
(``driver.host``: a driver another one replaced stops), the plan a driver taking over runs (``plan.json``) and its
end (``driver.ended``): what ``status``, ``why`` and the sentinel read. Torch-free."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..files import atomic_write
from .base import Folder

__all__ = ["DriverLiveness"]


@dataclass(frozen=True)
class DriverLiveness(Folder):
    """Is the job's driver alive (``JobFiles.driver``)?"""

    def beat(self) -> None:
        """The driver is alive (the heartbeat's mtime)."""
        try:
            if self._present(self.path(self.ALIVE)):
                os.utime(self.path(self.ALIVE), follow_symlinks=False)
            else:
                atomic_write(self.path(self.ALIVE), "")
        except OSError:
            pass

    def silent_for(self, now: float | None = None) -> float | None:
        """Seconds since the driver's last heartbeat (None: it never beat, or it ended)."""
        if self._present(self.path(self.DRIVER_END)):
            return None
        beat = self._mtime(self.path(self.ALIVE))
        return None if beat is None else (now or time.time()) - beat

    def has_ended(self) -> bool:
        """The driver recorded the job's end (a dead driver did not)."""
        return self._present(self.path(self.DRIVER_END))

    def ended(self, why: str) -> None:
        try:
            atomic_write(self.path(self.DRIVER_END), why + "\n")
        except OSError:
            pass

    def last_beat(self) -> float | None:
        """The heartbeat's mtime as stored (the sentinel compares it with the one before, never with its own clock:
        another node's clock may be seconds off)."""
        return self._mtime(self.path(self.ALIVE))

    def started(self, host: str = "") -> None:
        """A driver starts on ``host``: it is the allocation's driver from now on (one before it, if alive, stops)."""
        self.path(self.DRIVER_END).unlink(missing_ok=True)
        try:
            atomic_write(self.path(self.DRIVER_HOST), f"{host} {os.getpid()}\n")
        except OSError:
            pass
        self.beat()

    def host(self) -> tuple[str, int] | None:
        """(host, pid) of the allocation's driver now, as the last one to start recorded it."""
        words = self._read(self.path(self.DRIVER_HOST)).split()
        return (words[0], int(words[1])) if len(words) == 2 and words[1].isdigit() else None

    def replaced(self, host: str, pid: int) -> bool:
        """Has another driver taken the place of the one at ``host``/``pid`` (a sentinel that took it for lost)?"""
        now = self.host()
        return now is not None and now != (host, pid)

    def watched_from(self, host: str) -> None:
        """The driver's sentinel runs on ``host`` now (one started before it, on a node lost since, stands down)."""
        try:
            atomic_write(self.path(self.SENTINEL_HOST), host + "\n")
        except OSError:
            pass

    def sentinel_host(self) -> str | None:
        return self._read(self.path(self.SENTINEL_HOST)).strip() or None

    def claim(self, dead: tuple[str, int] | None) -> bool:
        """Claim the place of the driver ``dead`` (host, pid): True for the one claimant that created the claim
        (``O_EXCL``), so two sentinels never both take over."""
        name = f"takeover-{dead[0]}-{dead[1]}" if dead else "takeover-unknown"
        try:
            os.close(os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except FileExistsError:
            return False
        except OSError:
            return True  # a folder that cannot record a claim cannot hold two drivers' records either
        return True

    def keep_plan(self, text: str) -> None:
        """The job's plan, for a driver that takes over on another node (0600: it holds the job's environment)."""
        try:
            atomic_write(self.path(self.PLAN), text, mode=0o600)
        except OSError:
            pass

    def plan(self) -> str:
        """The plan the first driver kept ('' when missing or not the job owner's)."""
        return self._read(self.path(self.PLAN), limit=1 << 20)
