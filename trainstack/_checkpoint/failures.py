"""Why a checkpoint write failed, in words a user can act on (a full disk, a quota, permissions)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

_REASONS = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "the file system is read-only", errno.EDQUOT: "the disk quota is exceeded"}


def why_failed(exc: BaseException, folder: Path) -> str:
    """The cause of a failed write in words. torch reports a full disk as a RuntimeError from its zip writer, so
    when no OSError is attached the free space decides."""
    causes: list[BaseException] = [exc]
    while causes:
        cause = causes.pop()
        if isinstance(cause, OSError) and cause.errno in _REASONS:
            return _REASONS[cause.errno]
        causes += [c for c in (cause.__cause__, cause.__context__) if c is not None]
        causes += [c for c in getattr(cause, "failures", {}).values() if isinstance(c, BaseException)]  # DCP's
    try:
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize < 1 << 20:
            return _REASONS[errno.ENOSPC]
    except OSError:
        pass
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return (text.strip().splitlines() or [type(exc).__name__])[0][:300]
