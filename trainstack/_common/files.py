"""Small file helpers shared by the launcher, the generator, the trainer and the job runner.

* ``temp_path`` / ``TEMP_RE``: the one naming rule for temp files (``.<name>.tmp-<pid>``), so a run can
  recognise and remove what a killed writer left.
* ``atomic_write``: a file appears under its name only when complete (temp file + ``os.replace``).
* ``create_new`` / ``open_append``: never follow a symbolic link someone planted in a shared folder
  (``O_NOFOLLOW``; temp files ``O_EXCL``).
* ``private_dir`` / ``load_private_pickle``: pickles are only ever read from folders and files that this
  user owns and nobody else can write, because unpickling runs code (a planted pickle is code execution).
* ``read_back`` / ``read_back_text`` / ``read_jsonl``: the one reader of everything trainstack reads back (job
  folders, staged copies, logs, profiles): no link followed, never blocked on a FIFO or a device, a size bound, and
  -- where the file decides what a process does -- its owner checked and nobody else able to write it. Anything
  else is an ``UnreadableFile`` that names the file and what is wrong; ``pass_over`` says it once and moves on.
* ``own_folder``: a folder trainstack writes records into is its user's and nobody else's to write.
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

from ..errors import TrainstackError

__all__ = ["atomic_write", "private_dir", "check_private", "load_private_pickle", "UntrustedFileError", "temp_path",
           "TEMP_RE", "create_new", "open_append", "fsync_path", "untrusted_folder", "url_scheme", "read_back",
           "read_back_text", "read_jsonl", "UnreadableFile", "pass_over", "own_folder", "SMALL", "LARGE",
           "deny_others_write"]

#: The size bounds of what is read back: a record (an offer, a marker, a lease, a listing) and a log or a timeline
#: (only its newest LARGE bytes are read).
SMALL, LARGE = 1 << 20, 64 << 20

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


class UnreadableFile(UntrustedFileError):
    """A file read back that is not what it must be: a link, not a regular file, too large, someone else's."""

    def __init__(self, path: str | os.PathLike, why: str) -> None:
        super().__init__(f"{path} {why}")
        self.path, self.why = Path(path), why


def read_back(path: str | os.PathLike, limit: int = SMALL, owner: int | None = -1, tail: bool = False,
              head: bool = False) -> bytes:
    """The bytes of ``path`` as data trainstack reads back: opened without following a link and without blocking
    (a FIFO, a device, a folder are refused), at most ``limit`` bytes (more is refused; with ``tail`` only the
    newest ``limit`` bytes are read, with ``head`` the first, each cut at a line). ``owner``: the uid the file must
    belong to, writable by nobody else (-1: this user; None: anyone's, e.g. a log). A missing file raises
    FileNotFoundError; anything else ``UnreadableFile``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnreadableFile(path, "is a symbolic link (planted in a shared folder?): not followed") from None
        raise UnreadableFile(path, f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(path, "is not a regular file (a FIFO, a device or a folder): not read")
        uid = os.getuid() if owner == -1 else owner
        if uid is not None and st.st_uid != uid:
            raise UnreadableFile(path, f"belongs to uid {st.st_uid}, not to uid {uid}: someone else wrote it")
        if uid is not None and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnreadableFile(path, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): anyone "
                                       f"could have written it")
        if st.st_size > limit and not (tail or head):
            raise UnreadableFile(path, f"holds {st.st_size} bytes, more than the {limit} such a record may have")
        if tail and st.st_size > limit:
            os.lseek(fd, st.st_size - limit, os.SEEK_SET)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        if not (tail or head):
            raise UnreadableFile(path, f"holds more than the {limit} bytes such a record may have")
        data = data[-limit:] if tail else data[:data.rfind(b"\n", 0, limit) + 1]
    if tail and st.st_size > limit:  # the first line was cut by the bound
        data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
    return data


def read_back_text(path: str | os.PathLike, limit: int = SMALL, owner: int | None = -1, tail: bool = False,
                   head: bool = False, quiet: bool = False) -> str:
    """``read_back`` as text: a missing file is empty, an unreadable one is passed over (said once, on stderr,
    unless ``quiet``) and empty."""
    try:
        return read_back(path, limit, owner, tail, head).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    except UnreadableFile as exc:
        if not quiet:
            pass_over(exc)
        return ""
    except OSError:
        return ""


_SAID: set[str] = set()


def pass_over(exc: UnreadableFile, what: str = "") -> None:
    """Say once per process (on stderr) that an unreadable file is passed over, naming it and why."""
    import sys

    line = f"trainstack: passing over {what or exc.path}: {exc}"
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)


def deny_others_write(root: str | os.PathLike) -> None:
    """Nothing under ``root`` (its folders and files; links are left as they are) writable by group or others:
    a job folder's code snapshot and driver run as its user, so nobody else may change them (``shutil.copy2`` keeps
    a group-writable source's mode, and ``mkdir`` follows the umask)."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
            os.chmod(root, stat.S_IMODE(st.st_mode) & ~0o022)
        return
    for folder, dirs, files in os.walk(os.fspath(root)):
        for name in [*dirs, *files, ""]:
            path = os.path.join(folder, name) if name else folder
            st = os.lstat(path)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)


def own_folder(folder: str | os.PathLike, mode: int = 0o755) -> Path:
    """``folder`` as a folder trainstack writes records into: created (``mode``, never group- or world-writable,
    whatever the umask) or, if there, a real folder of this user's, made unwritable by others. Someone else's (or a
    link) raises ``UntrustedFileError`` naming it."""
    folder = Path(folder)
    try:
        folder.mkdir(mode=mode & 0o755)
    except FileExistsError:
        pass
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedFileError(f"{folder} is not a folder (a symbolic link or a file, planted in a shared folder?). "
                                 f"HINT: remove it; trainstack creates it.")
    if st.st_uid != os.getuid():
        raise UntrustedFileError(f"{folder} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): someone else "
                                 f"created it, and what it holds cannot be trusted. HINT: remove it, or use a log "
                                 f"folder only you can write.")
    if st.st_mode & 0o022:
        os.chmod(folder, stat.S_IMODE(st.st_mode) & ~0o022)
    return folder


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
    """Open a text file for appending, refusing a symbolic link (a planted link would make us write elsewhere), a
    FIFO and someone else's file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedFileError(f"refusing to write {path}: it is a symbolic link (planted in a shared "
                                     f"folder?). HINT: remove it, or use a folder only you can write.") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UntrustedFileError(f"refusing to write {path}: it belongs to uid {st.st_uid}, not to you, or is not a "
                                 f"regular file (planted in a shared folder?). HINT: remove it, or use a folder only "
                                 f"you can write.")
    return os.fdopen(fd, "a", encoding="utf-8")


def read_jsonl(path: str | os.PathLike, owner: int | None = -1) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, oldest first (its newest ``LARGE`` bytes: ``read_back``, owned by
    ``owner``): a line cut short by a kill (or not an object) is skipped; a missing or unreadable file has none."""
    import json

    lines = read_back_text(path, LARGE, owner, tail=True).splitlines()
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
