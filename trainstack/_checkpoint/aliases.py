"""Other names for a checkpoint: ``best`` and ``last`` (and a callback's top-k files), in both formats.

An alias is a hard link (a sharded folder: a folder of hard links to its files), never a symbolic link: it stays
valid when the checkpoint it names is rotated away, it is read like any checkpoint by the readers that refuse
links, and it costs no space. It is replaced atomically (a file) or by two renames (a folder; a kill between them
leaves no alias, which the next run re-creates). File systems without hard links get a copy.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from .._common.files import temp_path

__all__ = ["link", "alias_path", "ALIASES"]

#: Names ``Trainer.load_checkpoint`` and ``trainstack checkpoint ... --best`` understand.
ALIASES = ("best", "last")


def alias_path(folder: Path, name: str) -> Path | None:
    """The checkpoint called ``name`` in the checkpoints ``folder`` (``name.pt`` or the sharded folder ``name``), if
    there is one."""
    for candidate in (folder / f"{name}.pt", folder / name):
        if candidate.is_file() or (candidate.is_dir() and not candidate.is_symlink()):
            return candidate
    return None


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copyfile(src, dst, follow_symlinks=False)


def link(src: Path, dst: Path) -> Path:
    """Make ``dst`` another name of the checkpoint ``src``, replacing an older ``dst``; returns ``dst``."""
    if src.resolve() == dst.resolve():
        return dst
    tmp = temp_path(dst)
    if not src.is_dir():
        tmp.unlink(missing_ok=True)
        _link_or_copy(src, tmp)
        os.replace(tmp, dst)
        return dst
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for item in src.iterdir():
            if item.is_file() and not item.is_symlink():
                _link_or_copy(item, tmp / item.name)
        old = None
        if dst.exists():
            old = temp_path(dst, suffix="-old")
            os.replace(dst, old)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return dst
