"""One job folder read back as untrusted data and written so nobody else can write it: the helpers every protocol
of the folder shares. Torch-free, stdlib only."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import SMALL, UnreadableFile, own_folder, pass_over, read_back_text
from .names import Names

__all__ = ["Folder"]


@dataclass(frozen=True)
class Folder(Names):
    """A job folder (an array task's own folder). ``owner``: the uid its records must belong to (None: the folder's
    own owner -- ``status`` of a teammate's job; the driver and the ranks, who act on what they read, trust only
    their own user's)."""

    folder: Path
    owner: int | None = None

    def path(self, name: str) -> Path:
        return self.folder / name

    @property
    def uid(self) -> int:
        """Whose records count here."""
        if self.owner is not None:
            return self.owner
        try:
            return self.folder.lstat().st_uid
        except OSError:
            return os.getuid()

    def _read(self, path: Path, limit: int = SMALL) -> str:
        """A record's text (``read_back``: the owner's, bounded, no link, no FIFO); '' when missing or passed over."""
        return read_back_text(path, limit, self.uid)

    def _json(self, path: Path) -> Any:
        try:
            return json.loads(self._read(path) or "null")
        except ValueError:
            pass_over(UnreadableFile(path, "is not JSON"))
            return None

    def _present(self, path: Path) -> bool:
        """``path`` is there as a file of the folder's owner (a flag someone else planted is not)."""
        try:
            st = path.lstat()
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == self.uid and not st.st_mode & 0o022

    def _mtime(self, path: Path) -> float | None:
        return path.lstat().st_mtime if self._present(path) else None

    def _sub(self, name: str) -> Path:
        """A subfolder records are written into: this user's only (``own_folder``)."""
        return own_folder(self.path(name))

    def _files_in(self, name: str, pattern: str) -> list[Path]:
        """The files matching ``pattern`` in subfolder ``name`` when that folder is the owner's (else none)."""
        folder = self.path(name)
        try:
            st = folder.lstat()
        except OSError:
            return []
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != self.uid or st.st_mode & 0o022:
            pass_over(UnreadableFile(folder, "is not a folder of the job's owner that only they can write"))
            return []
        return sorted(folder.glob(pattern))
