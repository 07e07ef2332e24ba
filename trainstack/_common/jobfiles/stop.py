"""The graceful stop between the driver and the trainer: the driver's request (``.stop``), the trainer's answers
(``.stop.saved``: its checkpoint is complete; ``.stop.finished``: the run had ended). Torch-free."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..files import atomic_write
from .base import Folder

__all__ = ["StopRequest"]


@dataclass(frozen=True)
class StopRequest(Folder):
    """The stop protocol of one job folder (``JobFiles.stop``); the trainer's side works from the stop file's path
    it was given (``TRAINSTACK_STOP_FILE``)."""

    @property
    def file(self) -> Path:
        return self.path(self.STOP)

    def request(self) -> None:
        try:
            atomic_write(self.file, "")
        except OSError:
            pass

    def answers(self) -> tuple[bool, bool]:
        """(saved, finished): the trainer checkpointed for a stop; the run had ended before a stop came."""
        return self._present(Path(f"{self.file}.saved")), self._present(Path(f"{self.file}.finished"))

    @staticmethod
    def requested(stop_file: str | os.PathLike) -> bool:
        """The trainer's poll: the driver asked for a graceful stop (a stop file of this user's only)."""
        return StopRequest(Path(stop_file).parent, os.getuid())._present(Path(stop_file))

    def clear(self) -> None:
        for suffix in ("", ".saved", ".finished"):
            Path(f"{self.file}{suffix}").unlink(missing_ok=True)

    @staticmethod
    def confirm_saved(stop_file: str, checkpoint: Path | None) -> None:
        """The trainer's answer to a stop request: its checkpoint is complete."""
        atomic_write(stop_file + ".saved", str(checkpoint or ""))

    @staticmethod
    def confirm_finished(stop_file: str, step: int) -> None:
        """The trainer's note that its run finished with its final checkpoint."""
        try:
            atomic_write(stop_file + ".finished", f"{step}\n")
        except OSError:
            pass
