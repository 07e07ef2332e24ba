"""Errors that cross the process boundary as themselves: a worker's ConfigError (a divergence, a missing NCCL
transport) is written into its plain-text failure report with a header line, and the launching process raises that
class again -- also a WorkerError with the rank -- so ``except ConfigError`` works the same on 1 and N processes."""

from __future__ import annotations

import functools
import json
from typing import Any

from .._common.transport import TransportError
from ..errors import ConfigError, TrainingDiverged, TrainstackError, UnknownField, WorkerError

__all__ = ["carried_header", "worker_error"]


_CLASSES: dict[str, type[TrainstackError]] = {"ConfigError": ConfigError, "UnknownField": UnknownField,
                                              "TrainingDiverged": TrainingDiverged, "TransportError": TransportError}
_MARK = "trainstack-error: "


def carried_header(exc: BaseException) -> str:
    """The first line of a worker's (plain-text) failure report when the launching process should raise the same
    class: a setting the user must change, or a diverged loss -- whatever the number of processes."""
    name = type(exc).__name__
    if name in _CLASSES and type(exc) is _CLASSES[name]:
        return _MARK + json.dumps({"type": name, "message": str(exc)}) + "\n"
    return ""


def worker_error(rank: int, detail: str, exitcode: int | None = None) -> WorkerError:
    """The launching process's error for a failed worker. A ConfigError (or divergence) raised in a worker is that
    class as well, so ``except ConfigError`` works on 1 or N processes; its message leads, the traceback is in
    ``.detail``."""
    head, _, rest = detail.partition("\n")
    if not head.startswith(_MARK):
        return WorkerError(rank, detail, exitcode)
    try:
        found = json.loads(head[len(_MARK):])
        name, message = str(found["type"]), str(found["message"])
    except (ValueError, KeyError, TypeError):
        return WorkerError(rank, rest, exitcode)
    if name not in _CLASSES:
        return WorkerError(rank, rest, exitcode)
    return _carrier(name)(rank, rest, exitcode, message=f"{message}\n(raised on worker rank {rank}; its "
                                                         f"traceback is the exception's .detail)")


@functools.cache
def _carrier(name: str) -> type[WorkerError]:
    """One class per carried name, made once; it pickles through ``_rebuild`` (it has no importable name)."""
    def reduce(self: WorkerError) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, (name, self.rank, self.detail, self.exitcode, str(self))

    return type(name, (WorkerError, _CLASSES[name]), {
        "__module__": __name__, "__reduce__": reduce,
        "__doc__": f"A {name} raised in a worker process (rank, detail, exitcode as WorkerError)."})


def _rebuild(name: str, rank: int, detail: str, exitcode: int | None, message: str) -> WorkerError:
    return _carrier(name)(rank, detail, exitcode, message=message)
