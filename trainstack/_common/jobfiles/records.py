"""What a job folder records of the job: its runs (``started``, the exit status, the attempt marks in the logs),
its timeline (``events.jsonl``), the retry policy's verdicts, the node checks, the training side's progress, run
folder and goodput ledger, the attempt reports, the user's cancel and submit's metadata. Torch-free."""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import atomic_write, open_append, read_jsonl
from .base import Folder
from .names import ATTEMPT_MARK, node_log, rank_log

__all__ = ["JobRecords"]


@dataclass(frozen=True)
class JobRecords(Folder):
    """The job's own records (``JobFiles`` is one)."""

    # ------------------------------------------------------------------ runs and the job's end
    def submitted_code(self) -> dict[str, Any]:
        """The submission's git record (``commit``, ``dirty``) from trainstack submit's metadata ({} without one)."""
        found = self.metadata().get("git")
        return dict(found) if isinstance(found, dict) else {}

    def metadata(self) -> dict[str, Any]:
        """trainstack submit's record of this job ({} without one, or an unreadable one)."""
        found = self._json(self.path(self.METADATA))
        return found if isinstance(found, dict) else {}

    def mark_started(self) -> None:
        with open_append(self.path(self.STARTED)) as fh:
            fh.write(datetime.datetime.now().astimezone().isoformat(timespec="seconds") + "\n")

    def starts(self) -> list[str]:
        return [line.strip() for line in self._read(self.path(self.STARTED)).splitlines() if line.strip()]

    def runs_before(self) -> int:
        """How many times this job ran its program before the current run (requeues and retries alike)."""
        return max(0, len(self.starts()) - 1)

    def attempt_start(self) -> float:
        """When the current run started (the last line of ``started``), 0 when unknown."""
        lines = self.starts()
        try:
            return datetime.datetime.fromisoformat(lines[-1]).timestamp() if lines else 0.0
        except ValueError:
            return 0.0

    def has_started(self) -> bool:
        return self._present(self.path(self.STARTED))

    def write_exit_code(self, status: int) -> None:
        try:
            atomic_write(self.path(self.EXIT_CODE), f"{status}\n")
        except OSError:  # a folder deleted meanwhile must not turn success into failure
            pass

    def clear_exit_code(self) -> None:
        self.path(self.EXIT_CODE).unlink(missing_ok=True)

    def exit_code(self) -> str | None:
        """The recorded exit status (its last line), or None when the job never wrote one."""
        lines = self._read(self.path(self.EXIT_CODE)).strip().splitlines()
        return lines[-1].strip() if lines else None

    def exit_code_time(self) -> float | None:
        return self._mtime(self.path(self.EXIT_CODE))

    def started_time(self) -> float | None:
        return self._mtime(self.path(self.STARTED))

    def mark_attempt_in_logs(self, label: str) -> None:
        """``=== trainstack: attempt LABEL starts at ...`` in every rank and node log already there."""
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        for log in [*self.folder.glob(rank_log("*")), *self.folder.glob(node_log("*"))]:
            try:
                with open_append(log) as fh:
                    fh.write(f"{ATTEMPT_MARK}{label} starts at {stamp}\n")
            except OSError:
                pass

    # ------------------------------------------------------------------ the user's cancel
    def cancel(self) -> None:
        atomic_write(self.path(self.CANCELLED), "")

    def cancelled(self) -> bool:
        """``trainstack cancel`` marked this folder (or, for an array task, the whole array's)."""
        return self._present(self.path(self.CANCELLED)) or \
            (self.folder.name.startswith("task-") and self._present(self.folder.parent / self.CANCELLED))

    # ------------------------------------------------------------------ node checks
    @property
    def node_check_dir(self) -> Path:
        return self.path(self.NODE_CHECK)

    def node_check_figures(self, host: str) -> Any:
        return self._json(self.node_check_dir / f"{host}.json")

    def node_check_links(self) -> Any:
        return self._json(self.node_check_dir / "links.json")

    def node_checks(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path(self.NODE_CHECKS), self.uid)

    def append_node_check(self, record: dict[str, Any]) -> None:
        self._append(self.NODE_CHECKS, record)

    # ------------------------------------------------------------------ verdicts and events
    def verdicts(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path(self.VERDICTS), self.uid)

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_file, self.uid)

    def append_verdict(self, record: dict[str, Any]) -> None:
        self._append(self.VERDICTS, record)

    @property
    def events_file(self) -> Path:
        return self.path(self.EVENTS)

    def record_event(self, kind: str, /, **fields: Any) -> None:
        """Append ``{"kind": kind, "time": now, **fields}`` to the job's timeline (one write, never through a
        planted link; never raises: a read-only or deleted job folder must not stop the run)."""
        line = json.dumps({"kind": kind, "time": time.time(), **fields}, default=str) + "\n"
        try:
            fd = os.open(self.events_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError:
            pass

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open_append(self.path(name)) as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    # ------------------------------------------------------------------ what the training side leaves
    def write_progress(self, step: int) -> None:
        atomic_write(self.path(self.PROGRESS), json.dumps({"step": step, "time": time.time()}))

    def progress_step(self) -> int | None:
        found = self._json(self.path(self.PROGRESS))
        return int(found["step"]) if isinstance(found, dict) and type(found.get("step")) is int else None

    def write_run_folder(self, folder: Path) -> None:
        atomic_write(self.path(self.RUN_FOLDER), f"{folder.resolve()}\n")

    def run_folder(self) -> str:
        return self._read(self.path(self.RUN_FOLDER)).strip()

    def own_ledger_dir(self) -> Path:
        """The ledger folder, to write into (this user's only)."""
        return self._sub(self.LEDGER)

    def ledger_files(self) -> list[Path]:
        return self._files_in(self.LEDGER, "*.json")

    def ledger(self, path: Path) -> Any:
        return self._json(path)

    def has_script(self) -> bool:
        return self._present(self.path(self.SCRIPT))

    def report(self, restart: int, step_index: int, suffix: str) -> Path:
        """The attempt report of job step ``restart.step_index`` (``.txt`` or ``.json``)."""
        return self.path(f"attempt-{restart}.{step_index}{suffix}")
