"""The verbs a scheduler backend answers for the command line (torchx's ``Scheduler``: a small protocol, one module
per backend, a table of backends): check and submit a launch, say when it would start, list and describe jobs, why
one ended, its logs, wait for it, cancel it, debug it, free what it left on its nodes. The command line asks
``backend()`` and never spells a scheduler's command. Torch-free, stdlib only."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._slurm.spec import LaunchSpec
    from .._slurm.status import TaskStatus
    from .._slurm.submission import SubmittedJob
    from .._slurm.verdict import Verdict

__all__ = ["Backend", "BACKENDS", "backend"]

#: Scheduler name -> "module:class" of its backend, imported when asked for (a backend's room loads only then).
BACKENDS = {"slurm": "trainstack._slurm.backend:SlurmBackend"}


class Backend(Protocol):
    """One scheduler, as the command line uses it."""

    name: str

    # ------------------------------------------------------------------ before a job
    def check(self, spec: LaunchSpec) -> None:
        """Refuse (``SpecError``) what the scheduler would accept but the job could never run."""
        ...

    def expected_start(self, script: str, spec: LaunchSpec) -> dict[str, Any]:
        """When the rendered ``script`` would start (``{"start_in_s": ..., ...}``), submitting nothing."""
        ...

    def submit(self, spec: LaunchSpec, **options: Any) -> SubmittedJob:
        """Submit ``spec`` (its job folder, metadata and code snapshot); ``options`` as ``submit_spec``'s."""
        ...

    def submission_lines(self, spec: LaunchSpec, job: SubmittedJob | None) -> list[str]:
        """What a submission says beside its id: a sweep's task table (``job`` None: before submitting), notes."""
        ...

    def find_submission(self, token: str) -> str | None:
        """The job a submission token names (a ``--host`` submit that lost its connection)."""
        ...

    # ------------------------------------------------------------------ jobs
    def jobs(self, job_ids: Sequence[str], limit: int = 20) -> list[TaskStatus]:
        """A row per job (per array task) of ``job_ids``; none given: this user's queued, running and recent."""
        ...

    def table(self, rows: list[TaskStatus]) -> str:
        ...

    def problem(self) -> str | None:
        """Why the scheduler cannot be asked here (None: it can)."""
        ...

    def verdict(self, row: TaskStatus) -> Verdict:
        """Why a job ended (or what holds it, while pending)."""
        ...

    def exit_status(self, state: str) -> int:
        ...

    def log(self, job_id: str, rank: int | None = None) -> Path:
        ...

    def follow(self, job_id: str, rank: int | None, echo: Callable[[str], None], offset: int = 0) -> TaskStatus:
        """Print the log as it grows until the job ends; its last row."""
        ...

    def wait(self, job_id: str, timeout: float | None = None) -> tuple[int, str]:
        """Until the job ends: (its exit status, its state); TimeoutError after ``timeout``."""
        ...

    def cancel(self, job_id: str) -> list[str]:
        ...

    def debug(self, job_id: str, wait_s: float, echo: Callable[[str], None]) -> Path | None:
        """Every rank's stacks of a running job; the folder they are in."""
        ...

    def free_memory(self, job_id: str, wait_s: int = 60) -> tuple[list[str], list[str]]:
        """Free the memory checkpoints an ended job left on its nodes: (hosts, folders)."""
        ...


def backend(name: str = "slurm") -> Backend:
    """The backend of scheduler ``name``; a ValueError naming the known ones."""
    if name not in BACKENDS:
        raise ValueError(f"no backend for scheduler {name!r}; known: {', '.join(sorted(BACKENDS))}")
    module, _, cls = BACKENDS[name].partition(":")
    made: Backend = getattr(importlib.import_module(module), cls)()
    return made
