"""Exceptions raised by trainstack. Every message says what was found and how to fix it."""

from __future__ import annotations

import functools
import json

__all__ = ["TrainstackError", "ConfigError", "UnknownField", "LaunchError", "WorkerError", "TrainingHung",
           "TrainingDiverged", "Preempted", "Interrupted", "carried_header", "worker_error"]


class TrainstackError(Exception):
    """Base class of every error trainstack raises on purpose."""


class ConfigError(TrainstackError, ValueError):
    """A setting is invalid or contradicts another one (raised before any work starts)."""


class UnknownField(ConfigError, TypeError):
    """A keyword no config field has (a ``TypeError`` too, as Python's own error for it is)."""


class LaunchError(TrainstackError, RuntimeError):
    """The process layout cannot work: launcher variables, nprocs and devices disagree."""


class WorkerError(TrainstackError, RuntimeError):
    """A spawned worker failed; carries its rank and its traceback."""

    def __init__(self, rank: int, detail: str, exitcode: int | None = None, message: str | None = None) -> None:
        self.rank = rank
        self.detail = detail
        self.exitcode = exitcode
        super().__init__(message or f"worker rank {rank} failed" + (f" (exit code {exitcode})" if exitcode else "")
                         + f":\n{detail}")


class TrainingHung(WorkerError):
    """The hang watchdog found no rank making progress; its report names the rank that was behind and where."""


class TrainingDiverged(TrainstackError, RuntimeError):
    """The training loss became NaN or infinite; training stopped and the last finite checkpoint was kept."""


class Preempted(SystemExit):
    """Training stopped on request (signal or stop file) after writing a complete checkpoint.

    A ``SystemExit`` with status 0, so ``except Exception`` does not swallow it, the process exits cleanly, and
    torchrun does not count it as a failure; the batch script requeues and ``resume="auto"`` continues.
    """

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Interrupted(Preempted):
    """Training stopped after a Ctrl-C, with a complete checkpoint to continue from (exit status 130, as a shell
    reports an interrupted command)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 130


_CARRIED = ("ConfigError", "UnknownField", "TrainingDiverged")
_MARK = "trainstack-error: "


def carried_header(exc: BaseException) -> str:
    """The first line of a worker's (plain-text) failure report when the launching process should raise the same
    class: a setting the user must change, or a diverged loss -- whatever the number of processes."""
    name = type(exc).__name__
    if name in _CARRIED and type(exc) is globals()[name]:
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
    if name not in _CARRIED:
        return WorkerError(rank, rest, exitcode)
    return _carrier(name)(rank, rest, exitcode, message=f"{message}\n(raised on worker rank {rank}; its "
                                                         f"traceback is the exception's .detail)")


@functools.cache
def _carrier(name: str) -> type[WorkerError]:
    return type(name, (WorkerError, globals()[name]), {"__module__": __name__, "__doc__": f"A {name} raised in a "
                                                       f"worker process (rank, detail, exitcode as WorkerError)."})
