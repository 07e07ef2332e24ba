"""The memory checkpoints a job leaves in its nodes' ``/dev/shm`` (``memory-folders``): the ranks list them, the
driver frees them at the job's end with ``FREE_MEMORY_SH`` -- which computes what it deletes from this user's memory
root and the job id; the listing contributes only roots, each checked (``roots``). Torch-free."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..files import UnreadableFile, open_append, pass_over
from .base import Folder

__all__ = ["MemoryListing"]


@dataclass(frozen=True)
class MemoryListing(Folder):
    """A job's memory-checkpoint listing (``JobFiles.memory``)."""

    def record(self, folder: Path) -> None:
        """A /dev/shm folder of memory checkpoints the driver frees on every node at the job's end (only its root
        is ever used: ``memory_roots``)."""
        known = self.folders()
        if str(folder) not in known:
            with open_append(self.path(self.MEMORY_FOLDERS)) as fh:
                fh.write(f"{folder}\n")

    def folders(self) -> list[str]:
        return [line for line in self._read(self.path(self.MEMORY_FOLDERS)).splitlines() if line.strip()]

    def freed_on(self, host: str) -> None:
        """A rank on ``host`` freed its own copies (a finished run): one line per rank."""
        with open_append(self.path(self.MEMORY_FREED)) as fh:
            fh.write(f"{host}\n")

    def left_on(self, hosts: list[str], ranks_per_host: int) -> list[str]:
        """The ``hosts`` where copies may be left: all but those where every rank said it freed its own."""
        said = self._read(self.path(self.MEMORY_FREED)).split()
        return [h for h in hosts if said.count(h) < ranks_per_host]

    def roots(self) -> list[str]:
        """The memory roots (``<dir>/trainstack-<uid>``) the job's listing names, each checked: an absolute, normal
        path (no ``..``, no trailing ``/``) ending in this user's ``trainstack-<uid>``, above a ``job-*`` entry.
        ``FREE_MEMORY_SH`` removes only that job's folders directly inside them."""
        roots: list[str] = []
        for line in self.folders():
            root, name = os.path.split(line)
            if not (line.startswith("/") and os.path.normpath(line) == line and name.startswith("job-")
                    and os.path.basename(root) == f"trainstack-{os.getuid()}" and "\n" not in line):
                pass_over(UnreadableFile(self.path(self.MEMORY_FOLDERS), f"names {line[:200]!r}, not a memory "
                                                                         f"checkpoint folder of this user's"))
                continue
            if root not in roots:
                roots.append(root)
        return roots

    def forget(self) -> None:
        self.path(self.MEMORY_FOLDERS).unlink(missing_ok=True)
        self.path(self.MEMORY_FREED).unlink(missing_ok=True)
