"""Small file helpers shared by the launcher, the generator, the trainer and the job runner.

* ``temp_path`` / ``TEMP_RE``: the one naming rule for temp files (``.<name>.tmp-<pid>``), so a run can
  recognise and remove what a killed writer left.
* ``atomic_write``: a file appears under its name only when complete (temp file + ``os.replace``).
* ``create_new`` / ``open_append``: never follow a symbolic link someone planted in a shared folder
  (``O_NOFOLLOW``; temp files ``O_EXCL``).
* ``private_dir`` / ``load_private_pickle``: pickles are only ever read from folders and files that this
  user owns and nobody else can write, because unpickling runs code (a planted pickle is code execution).
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

from .errors import TrainstackError

__all__ = ["atomic_write", "private_dir", "check_private", "load_private_pickle", "UntrustedFileError", "temp_path",
           "TEMP_RE", "create_new", "open_append", "fsync_path", "untrusted_folder",
           "url_scheme"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_URL_AS_PATH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")  # Path("s3://b") is already PosixPath("s3:/b")


def url_scheme(value: object) -> str | None:
    """The scheme of a URL-like path (``s3://bucket/runs`` -> ``s3``, also once made a ``Path``), else None:
    trainstack's folders are file system paths, and ``Path("s3://b")`` would silently become a folder ``s3:``."""
    if isinstance(value, str):
        m = _URL.match(value)
    elif isinstance(value, os.PathLike):
        m = _URL_AS_PATH.match(os.fspath(value)) if isinstance(os.fspath(value), str) else None
    else:
        m = None
    return m.group(1) if m else None


#: Temp files of every writer here: ``.<final name>.tmp-<pid or rank>[<suffix>]``.
TEMP_RE = re.compile(r"^\..+\.tmp-\d+(\.[A-Za-z0-9]+)?$")


class UntrustedFileError(TrainstackError, PermissionError):
    """A file that would be unpickled could have been written by someone else."""


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file or a folder (a rename is durable once its folder is); best effort where the file system
    refuses to open folders."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - some file systems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def temp_path(path: str | os.PathLike, owner: int | None = None, suffix: str = "") -> Path:
    """Where ``path`` is written before it is renamed into place (``owner``: this process unless given)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid() if owner is None else owner}{suffix}")


def create_new(path: str | os.PathLike, mode: int = 0o644) -> int:
    """Open a new file for writing: a leftover of a killed writer is removed first, and an existing name (a link
    planted by someone else, even) is never opened (``O_EXCL | O_NOFOLLOW``). The umask applies to ``mode``."""
    path = Path(path)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)


def open_append(path: str | os.PathLike, mode: int = 0o644) -> IO[str]:
    """Open a text file for appending, refusing a symbolic link (a planted link would make us write elsewhere)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedFileError(f"refusing to write {path}: it is a symbolic link (planted in a shared "
                                     f"folder?). HINT: remove it, or use a folder only you can write.") from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, oldest first: a line cut short by a kill (or not an object) is
    skipped; a missing file has none."""
    import json

    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder, then rename; never a partial file. The
    umask applies (``mode`` is the most that is granted)."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = temp_path(path)
    fd = create_new(tmp, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def private_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new folder under ``parent`` that only this user can read and write (0700)."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def check_private(path: str | os.PathLike) -> None:
    """Raise unless ``path`` and its folder are owned by this user and writable by nobody else."""
    path = Path(path)
    uid = os.getuid()
    for item in (path.parent, path):
        try:
            st = item.lstat()
        except FileNotFoundError:
            raise UntrustedFileError(f"{item} does not exist.") from None
        if stat.S_ISLNK(st.st_mode):
            raise UntrustedFileError(f"refusing to load {path}: {item} is a symbolic link.")
        if st.st_uid != uid:
            raise UntrustedFileError(f"refusing to load {path}: {item} is owned by uid {st.st_uid}, not by you "
                                     f"(uid {uid}); another user may have written it. HINT: resubmit; trainstack "
                                     f"keeps these files in a private (0700) folder.")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UntrustedFileError(f"refusing to load {path}: {item} is writable by other users (mode "
                                     f"{stat.S_IMODE(st.st_mode):o}). HINT: resubmit; trainstack keeps these files "
                                     f"in a private (0700) folder.")


def load_private_pickle(path: str | os.PathLike) -> Any:
    """Unpickle ``path`` after ``check_private`` (the only way trainstack reads a pickle from disk)."""
    check_private(path)
    with open(path, "rb") as fh:
        return pickle.load(fh)


#: Why a write failed, in words a user can act on (one table for checkpoints, metrics and every file trainstack
#: writes).
WRITE_FAILURES = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                  errno.EROFS: "the file system is read-only", errno.EDQUOT: "the disk quota is exceeded"}


def untrusted_folder(folder: Path) -> str:
    """Why ``folder`` (a compile cache) cannot be trusted, or '' (a missing one is created 0700 here). It must be this
    user's, in a folder nobody else can rename it from (not writable by others, unless sticky), and either private
    (0700: nothing in it is reachable by others) or, found open, holding nothing anyone else could have written --
    then it is made private."""
    uid = os.getuid()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        parent, st = folder.parent.stat(), folder.lstat()
    except OSError as exc:
        return f"it cannot be created ({exc.strerror})"
    if parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
        return f"the folder holding it, {folder.parent}, is writable by other users (mode {parent.st_mode & 0o7777:o})"
    if stat.S_ISLNK(st.st_mode) or st.st_uid != uid:
        return f"{folder} is a symbolic link or belongs to uid {st.st_uid}, not to you"
    if st.st_mode & 0o077:  # found open: everything in it must be ours and unwritable by others
        for item in (folder, *folder.rglob("*")):
            try:
                mine = item.lstat()
            except OSError:
                continue  # removed meanwhile
            if mine.st_uid != uid:
                return f"{item} belongs to uid {mine.st_uid}, not to you"
            if mine.st_mode & 0o022 and not stat.S_ISLNK(mine.st_mode):
                return f"{item} is writable by other users (mode {mine.st_mode & 0o7777:o})"
        folder.chmod(0o700)
    return ""
