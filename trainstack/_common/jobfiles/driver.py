"""The allocation driver's liveness: its heartbeat (``driver.alive``'s mtime, touched every few seconds) and its
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

    def started(self) -> None:
        self.path(self.DRIVER_END).unlink(missing_ok=True)
        self.beat()
