"""The job folder's contents, owned here: every file name inside ``<log dir>/<name>-<job id>/`` (``names``) and the
one way to read or write each, split by protocol -- the driver <-> rank step records (``JobFiles.step``: the
in-place contract), the graceful stop (``.stop``), the driver's liveness (``.driver``), the memory listing
(``.memory``) and the job's own records (``JobFiles`` itself: runs, timeline, verdicts, node checks, ledger). The
allocation driver, the verdicts, ``status``, the reports, the goodput ledger, the watchdog, the graceful stop and the
memory checkpoints all go through it; no other module spells a name. ``JobPaths`` (``_slurm/jobfolder.py``) owns
where the folder is, this package what is in it. Torch-free leaf.

Everything here is read back as untrusted data (``_files.read_back``): a record must belong to the folder's owner
(this user, for the driver and the ranks, who act on it) and be writable by nobody else, or it is passed over with
a line that names it; every file and subfolder is written so that nobody else can write it, whatever the umask, and
never through a link someone planted.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .. import envvars as envvars
from ..files import UntrustedFileError, own_folder
from .driver import DriverLiveness
from .memory import MemoryListing
from .names import (
    ATTEMPT_MARK,
    DRIVER_BEAT_S,
    DRIVER_QUIET_S,
    DRIVER_SILENT_S,
    DRIVER_SUSPECT_S,
    EXIT_RECORD_SH,
    FREE_MEMORY_SH,
    OFFERED,
    RANK_LOG_RE,
    node_log,
    rank_log,
    rank_stacks,
    rank_unit,
)
from .records import JobRecords
from .standby import STANDBY_NAME, Ready, StandbyRecords
from .step import Exit, Offer, StepRecords
from .stop import StopRequest

__all__ = ["JobFiles", "Exit", "Offer", "StepRecords", "StandbyRecords", "Ready", "STANDBY_NAME", "StopRequest",
           "DriverLiveness", "MemoryListing",
           "EXIT_RECORD_SH", "FREE_MEMORY_SH", "DRIVER_SILENT_S", "DRIVER_QUIET_S", "DRIVER_BEAT_S",
           "DRIVER_SUSPECT_S", "ATTEMPT_MARK", "OFFERED",
           "UntrustedFileError", "rank_log", "node_log", "rank_stacks", "rank_unit", "RANK_LOG_RE"]


@dataclass(frozen=True)
class JobFiles(JobRecords):
    """One job folder and everything in it: its records, and its protocols by name."""

    @classmethod
    def current(cls) -> JobFiles | None:
        """The folder of the job this process runs in (``TRAINSTACK_JOB_DIR``), or None outside a job."""
        folder = os.environ.get(envvars.JOB_DIR)
        return cls(Path(folder), os.getuid()) if folder else None

    @classmethod
    def mine(cls, folder: Path) -> JobFiles:
        """A job folder this process acts on (the driver, the sentinel, the ranks): only this user's records count."""
        return cls(Path(folder), os.getuid())

    @property
    def step(self) -> StepRecords:
        """The driver <-> rank records of the job steps (exits, lost peers, offers, joins)."""
        return StepRecords(self.folder, self.owner)

    @property
    def standby(self) -> StandbyRecords:
        """The warm standbys' records (ready, ordered, the rank each became)."""
        return StandbyRecords(self.folder, self.owner)

    @property
    def stop(self) -> StopRequest:
        """The graceful stop's request and answers."""
        return StopRequest(self.folder, self.owner)

    @property
    def driver(self) -> DriverLiveness:
        """The allocation driver's heartbeat and end."""
        return DriverLiveness(self.folder, self.owner)

    @property
    def memory(self) -> MemoryListing:
        """The memory-checkpoint folders the job's ranks listed."""
        return MemoryListing(self.folder, self.owner)

    def make_own(self) -> None:
        """The job folder as this user's: created (never writable by group or others, whatever the umask) or, if
        there, checked to be this user's and made unwritable by others; someone else's raises
        ``UntrustedFileError``."""
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        own_folder(self.folder)

    def seal_logs(self) -> None:
        """The files programs wrote here with the user's umask (NCCL's ``nccl.*.log``, its flight recorder's dumps,
        scontrol's ``slurm_job_*_resize.*`` after a hand-back) made unwritable by others: ``why`` reads the logs as
        this user's, and nothing in a job folder is anyone else's to change."""
        for path in [*self.folder.glob("nccl.*.log"), *self.folder.glob("nccl-trace-rank-*"),
                     *self.folder.glob("slurm_job_*_resize.*")]:
            try:
                st = path.lstat()
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o022:
                    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022, follow_symlinks=False)
            except (OSError, NotImplementedError):
                continue

    def rank_logs(self) -> list[Path]:
        """The rank and node logs of the job's tasks (``rank-<r>.out``, ``node-<n>.out``)."""
        return [*self.folder.glob(rank_log("*")), *self.folder.glob(node_log("*"))]
