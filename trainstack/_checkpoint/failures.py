"""Why a checkpoint write failed or a checkpoint cannot be read, in words a user can act on (a full disk, a quota,
permissions; not a checkpoint, a refused object, damage)."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from .._common.files import WRITE_FAILURES

_REASONS = WRITE_FAILURES


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


_FOREIGN = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_UNPICKLER = re.compile(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", re.DOTALL)


def why_unreadable(exc: BaseException, file: Path) -> str:
    """Why ``torch.load(file, weights_only=True)`` failed: not a checkpoint at all, an object we refuse to unpickle
    (with its name and the way out), or damage -- never torch's advice to turn the safety off."""
    try:
        with open(file, "rb") as f:
            head = f.read(8)
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    if not head:
        return "the file is empty (a save that never wrote?)"
    if not head.startswith((b"PK\x03\x04", b"\x80")):
        return f"it is not a torch checkpoint: it starts with {head!r} (torch.save writes a zip archive)"
    found = _FOREIGN.search(str(exc))
    if found:
        return (f"it holds a {found.group(1)} object, which trainstack does not unpickle (checkpoints are loaded "
                f"weights_only: a pickle can run code). HINT: keep tensors, numbers and strings in checkpoints; "
                f"torch.serialization.add_safe_globals([...]) allows a class you trust")
    text = str(exc)
    unpickler = _UNPICKLER.search(text)
    if unpickler:  # torch's own reason, without its advice to load unsafely
        return f"it is not a checkpoint torch.save wrote, or it is damaged (the safe loader stopped at: " \
               f"{' '.join(unpickler.group(1).split())[:200]})"
    first = (text.strip().split(". ")[0].splitlines() or [""])[0]
    return f"the file is damaged or not a torch checkpoint ({type(exc).__name__}: {first[:200]})"
