"""Lost hosts handed back: once the job no longer uses a lost node, the running job is shrunk without it (Slurm
lets a job's owner do so; asked in the background, Slurm may take seconds to allow it), so the job's end does not
wait for Slurm to declare the node dead (SlurmdTimeout, 300 s by default) and nobody pays for it meanwhile.
Torch-free, stdlib only."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .slurmcmd import RELEASE_S

if TYPE_CHECKING:
    from .batchjob import BatchJob
    from .slurmcmd import Slurm

__all__ = ["HandBack"]


class HandBack:
    """The hosts the allocation holds (``held``), less those handed back."""

    def __init__(self, slurm: Slurm, job: BatchJob) -> None:
        self.slurm, self.job = slurm, job
        self.held: list[str] = []
        self._asking: threading.Thread | None = None

    def hold(self, hosts: list[str]) -> None:
        """What the allocation holds: ``hosts`` (a lost batch host is not: Slurm refuses to be asked for it, and
        takes it out itself)."""
        self.held = list(hosts)

    def lost(self, hosts: list[str], step: int, wait: bool = False) -> None:
        """Hand the lost ``hosts`` the job still holds back, once each; ``wait``: the job's end, which waits for the
        answer."""
        gone = [h for h in hosts if h in self.held]
        if gone:
            self.held = keep = [h for h in self.held if h not in gone]
            self._asking = threading.Thread(target=self._release, args=(gone, keep, step), daemon=True,
                                            name="trainstack-release")
            self._asking.start()
        if wait and self._asking is not None:
            self._asking.join(RELEASE_S + 5)

    def _release(self, gone: list[str], keep: list[str], step: int) -> None:
        done, answer = self.slurm.release(keep, self.job.files.folder)
        self.job.files.seal_logs()  # scontrol's resize scripts, written with the user's umask
        if done:
            self.job.say(f"handed {','.join(gone)} back to Slurm (lost; the job goes on with {','.join(keep)})"
                         + ("; Slurm had taken it out already" if answer.startswith("already") else ""))
            self.job.event("released", gone, step)
        else:
            self.job.warn(f"could not hand {','.join(gone)} back to Slurm ({answer}): the job's end waits until "
                          f"Slurm declares them dead")
