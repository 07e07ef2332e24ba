"""Exceptions raised by trainstack. Every message says what was found and how to fix it."""

from __future__ import annotations

__all__ = ["TrainstackError", "ConfigError", "LaunchError", "WorkerError"]


class TrainstackError(Exception):
    """Base class of every error trainstack raises on purpose."""


class ConfigError(TrainstackError, ValueError):
    """A setting is invalid or contradicts another one (raised before any work starts)."""


class LaunchError(TrainstackError, RuntimeError):
    """The process layout cannot work: launcher variables, nprocs and devices disagree."""


class WorkerError(TrainstackError, RuntimeError):
    """A spawned worker failed; carries its rank and its traceback."""

    def __init__(self, rank: int, detail: str, exitcode: int | None = None) -> None:
        self.rank = rank
        self.detail = detail
        self.exitcode = exitcode
        super().__init__(f"worker rank {rank} failed" + (f" (exit code {exitcode})" if exitcode else "")
                         + f":\n{detail}")
