"""Exceptions raised by trainstack. Every message says what was found and how to fix it."""

from __future__ import annotations

__all__ = ["TrainstackError", "CheckpointError", "UnreadableCheckpoint", "ConfigError", "UnknownField", "LaunchError",
           "WorkerError", "TrainingHung", "TrainingDiverged", "Preempted", "Interrupted"]


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
        default = f"worker rank {rank} failed" + (f" (exit code {exitcode})" if exitcode else "") + f":\n{detail}"
        super().__init__(message or default)


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


class CheckpointError(TrainstackError, OSError):
    """Saving or loading a checkpoint failed; the previous checkpoint is untouched."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint that cannot be read at all (damaged, truncated, foreign): ``resume="auto"`` falls back past it."""
