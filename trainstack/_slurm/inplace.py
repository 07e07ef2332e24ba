"""The driver's side of a restart in place (the trainer's: ``_runtime/inplace.py``): the ranks of a failed job step
that wait for the next one in their processes, the sruns that still hold them, and the launch of only the missing
ranks beside them. Torch-free.

A failed step whose every rank recorded its exit, went with its lost host or waits in place is not killed: its
srun is kept (``hold``; it runs with ``--no-kill``, so Slurm's verdict on a lost node ends only that node's tasks),
the retry policy decides as for any crash, and a next step that keeps every waiting rank at its place starts only
the missing ranks, all on one host (a crashed rank on its node, a lost node's ranks on the spare;
``TRAINSTACK_TASK_RANKS`` gives each task its global rank) -- or nothing, for a shrink to the survivors' nodes --
after the offer the waiting ranks take (``JobFiles.offer_rejoin``). Anything else -- a waiting rank whose place
would move, missing ranks on several hosts, a requeue or a stop -- kills the held ranks first (``release``) and
relaunches the whole step as before.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping

from .._common import envvars as envvars
from .._common.jobfiles import OFFERED, JobFiles
from .slurmcmd import Slurm

__all__ = ["Survivors"]

#: After a step's first failure, how long the driver waits for a first rank to say it waits in place (a rank
#: notices a lost peer at its next collective), then, once one has, for all of them; a rank that stays silent is
#: killed and relaunched with the rest (a program that is not the Trainer's, a rank stuck elsewhere).
FIRST_SIGN_S, ALL_WAITING_S = 2.0, 5.0
#: How long the ranks continued in place may take to join the next step (they leave themselves after
#: ``_runtime.inplace.JOIN_S``; this is the driver's own bound).
JOIN_S = 90.0


class Survivors:
    """The ranks of the last failed step waiting in place (rank -> host) and the srun processes that hold them."""

    def __init__(self, files: JobFiles, slurm: Slurm, keep_steps: Callable[[], set[str]], enabled: bool) -> None:
        self.files, self.slurm, self.keep_steps, self.enabled = files, slurm, keep_steps, enabled
        self.waiting: dict[int, str] = {}
        self.held: list[subprocess.Popen[bytes]] = []
        self.joining: tuple[int, set[int], float] | None = None  # (step, ranks, offered at): not yet joined
        self.carried_procs: list[subprocess.Popen[bytes]] = []  # sruns of earlier steps running in the current one
        self.join_s = JOIN_S

    @staticmethod
    def wanted(env: Mapping[str, str], warn: Callable[[str], None]) -> bool:
        """Restarts in place as the job's environment asks (``TRAINSTACK_IN_PLACE``: on unless a false word; a value
        that is neither is said, and off)."""
        try:
            return envvars.switch(envvars.IN_PLACE, True, env)
        except ValueError as exc:
            warn(f"{exc}: restarts in place are off")
            return False

    def all_waiting(self, step: int, world: int, gone: set[int]) -> bool:
        """Has every rank of job step ``step`` either recorded its exit, gone with its host (``gone``) or said it
        waits in place (some do)?"""
        if not self.enabled:
            return False
        waiting = self.files.step.waiting(step)
        exited = {x.rank for x in self.files.step.exits(step) if x.rank is not None}
        return bool(waiting) and set(range(world)) <= set(waiting) | exited | gone

    def grace(self, step: int, base: float) -> float:
        """How long failed job step ``step`` may take to end before it is killed: ``base``, and with restarts in
        place ``FIRST_SIGN_S`` for a rank to say it waits, ``ALL_WAITING_S`` once one has."""
        if not self.enabled:
            return base
        return max(base, ALL_WAITING_S if self.files.step.waiting(step) else FIRST_SIGN_S)

    def hold(self, procs: list[subprocess.Popen[bytes]], step: int) -> None:
        """Keep the failed step's sruns (its waiting ranks) for the next step."""
        self.held += procs
        self.waiting = self.files.step.waiting(step)

    def missing(self, nodes: list[str], per_node: int) -> tuple[str, list[int]] | None:
        """The host and ranks the next step on ``nodes`` starts beside the waiting ones (none: ``("", [])``, a shrink
        to the waiting ranks' nodes) -- None when it cannot continue them in place: a waiting rank not at its place
        in ``nodes`` (rank r runs on nodes[r // per_node]), or missing ranks on more than one host."""
        if not self.waiting:
            return None
        world = len(nodes) * per_node
        if any(r >= world or nodes[r // per_node] != host for r, host in self.waiting.items()):
            return None
        ranks = [r for r in range(world) if r not in self.waiting]
        hosts = {nodes[r // per_node] for r in ranks}
        return (hosts.pop() if hosts else "", ranks) if len(hosts) <= 1 else None

    def srun(self, words: list[str], nodes: list[str], tasks_per_node: int,
             beside: tuple[str, list[int]] | None) -> list[str]:
        """The step's srun words (with --requeue): a failed task leaves the others running (they may wait in
        place; the driver ends the step), on exactly ``nodes`` -- or only the ranks ``beside`` names, on their host."""
        if self.enabled:  # --no-kill: Slurm's verdict on a lost node (SlurmdTimeout later) ends no survivor
            words = [w.replace("--kill-on-bad-exit=1", "--kill-on-bad-exit=0") for w in words
                     if not w.startswith("--wait=")] + ["--wait=0", "--no-kill"]
        if beside is None:
            return [*words, f"--ntasks={len(nodes) * tasks_per_node}", f"--nodelist={','.join(nodes)}", "--overlap"]
        host, ranks = beside
        words = ["--nodes=1" if w.startswith("--nodes=") else f"--ntasks-per-node={len(ranks)}"
                 if w.startswith("--ntasks-per-node=") else w for w in words]
        return [*words, f"--ntasks={len(ranks)}", f"--nodelist={host}", "--overlap"]

    def offer(self, step: int, env: Mapping[str, str], per_node: int) -> None:
        """Tell the waiting ranks to join job step ``step`` (its rendezvous, counters and sizes from ``env``; each
        keeps its rank, in the block layout of ``per_node`` ranks per node)."""
        self.files.step.offer(step, {k: env[k] for k in OFFERED if k in env}, sorted(self.waiting), per_node)
        self.joining = (step, set(self.waiting), time.monotonic())

    def late(self, step: int) -> list[int]:
        """The ranks offered job step ``step`` that have not joined it ``JOIN_S`` after the offer (the step is then
        a failure: a survivor that cannot join is not counted as started)."""
        if self.joining is None or self.joining[0] != step:
            return []
        ranks = self.joining[1] - self.files.step.joined_ranks(step)
        if not ranks:
            self.joining = None
            return []
        return sorted(ranks) if time.monotonic() - self.joining[2] > self.join_s else []

    def release(self) -> None:
        """Kill the held ranks (the next step relaunches every rank, or none follows) and forget them."""
        if self.held:
            self.slurm.kill_steps(keep=self.keep_steps())
            for proc in self.held:
                proc.kill()
                proc.wait()
        self.held, self.waiting = [], {}

    @property
    def carried_any(self) -> bool:
        """Does a held srun of an earlier step still run (it may span a lost node)?"""
        return any(p.poll() is None for p in self.carried_procs)

    def carried(self) -> list[subprocess.Popen[bytes]]:
        """The held sruns, now part of the step that continues their ranks (forgotten here: the step owns them)."""
        held, self.held, self.waiting = self.held, [], {}
        self.carried_procs = list(held)
        return held
