"""What one job step of the allocation runs: its ``srun`` words (exactly its nodes, beside a failed step's remains,
or only the ranks a restart in place starts), every task through the exit-record wrapper, the command and the
program; its environment (the rendezvous on its first node at a port of its own, the attempt's counters, the ranks
of a step that starts only some, a shrunk step's process count). Torch-free, stdlib only."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from .._common import envvars as envvars
from .._common.jobfiles import EXIT_RECORD_SH

if TYPE_CHECKING:
    from .batchjob import BatchJob
    from .inplace import Survivors
    from .plan import Plan

__all__ = ["StepCommand", "TORCHRUN_SIGNALS"]

#: torchrun >= 2.9 forwards these to its workers; older ones stop on them (the stop then comes through the driver).
TORCHRUN_SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"

Beside = tuple[str, list[int]]  # (the node, the ranks) a step starts beside the ranks waiting in place


class StepCommand:
    """The command and environment of the allocation's job steps (``job_id``: the Slurm job's)."""

    def __init__(self, plan: Plan, job: BatchJob, in_place: Survivors, job_id: str) -> None:
        self.plan, self.job, self.in_place, self.job_id = plan, job, in_place, job_id

    def argv(self, nodes: list[str], beside: Beside | None = None) -> list[str]:
        """srun on ``nodes`` (with --requeue: exactly these, beside a failed step's remains; or only the ranks
        ``beside`` names, beside those waiting in place), every task through the exit-record wrapper, then the
        command and the program."""
        launch = self.plan.launch.on(len(nodes), self.plan.procs_per_node)
        srun = list(launch.srun)
        if self.plan.recovery.requeue:
            srun = self.in_place.srun(srun, nodes, launch.tasks_per_node, beside)
        command = [*launch.command, *([TORCHRUN_SIGNALS] if launch.torchrun and self.job.torchrun_signals else [])]
        program = [*launch.program, *(self.job.task_args if "CUSTOM_COMMAND" not in launch.env else [])]
        return [*srun, "bash", "-c", EXIT_RECORD_SH, "trainstack-task", launch.task_log, *command, *program]

    def env(self, nodes: list[str], step: int, beside: Beside | None = None) -> dict[str, str]:
        """Job step ``step``'s environment: the job's, the rendezvous on its first node (a port of its own for every
        step), the attempt's counters; restarts in place on, and the ranks of a step that starts only some."""
        port, plan = self.port(step), self.plan
        launch = plan.launch.on(len(nodes), plan.procs_per_node)
        env = {**self.job.env, **launch.env, "MASTER_ADDR": nodes[0], "MASTER_PORT": str(port),
               "PET_RDZV_ENDPOINT": f"{nodes[0]}:{port}",
               "PET_RDZV_ID": f"{self.job_id}.{step}" if plan.recovery.requeue else self.job_id,
               envvars.ATTEMPT: str(self.job.files.runs_before()), envvars.STEP: str(step)}
        if self.in_place.enabled:
            env[envvars.IN_PLACE] = "1"
        if beside is not None:
            env[envvars.TASK_RANKS] = f"{plan.procs_per_node}/{','.join(map(str, beside[1]))}"
            env[envvars.NPROCS] = str(len(nodes) * plan.procs_per_node)
        if len(nodes) < plan.nodes:  # a shrunk step: its own process count; the trainer keeps the global batch
            env[envvars.PLANNED_WORLD] = str(plan.nodes * plan.procs_per_node)
            env[envvars.NPROCS] = str(len(nodes) * plan.procs_per_node)
        if "CUSTOM_COMMAND" in env and self.job.task_args:
            env["CUSTOM_COMMAND"] += " " + " ".join(shlex.quote(a) for a in self.job.task_args)
        return env

    def standby(self, host: str, name: str) -> tuple[list[str], dict[str, str]]:
        """A warm standby's job step on ``host`` (named ``name``: a teardown keeps it while idle) and its
        environment: one task, through the exit-record wrapper (a standby is no rank until ordered), the
        interpreter running the standby before the program's words (torchrun's: the rank's environment is then
        torchrun's worker's); the step's rendezvous comes with the order."""
        launch = self.plan.launch
        form = launch.python_form()
        assert form is not None, "standbys only for a Python program (Plan.standbys)"
        srun = self.in_place.srun(list(launch.srun), [host], 1, (host, [0]))
        argv = [*srun, f"--job-name={name}", "bash", "-c", EXIT_RECORD_SH, "trainstack-task", "standby", *form[0],
                "-m", "trainstack._runtime.standby", name, *(["--torchrun"] if launch.torchrun else []), "--",
                *form[1], *self.job.task_args]
        env = {**self.job.env, **launch.env, **({envvars.IN_PLACE: "1"} if self.in_place.enabled else {})}
        return argv, env

    def port(self, step: int) -> int:
        """The rendezvous port of job step ``step`` (one of its own per step)."""
        job, base, span = int(self.job_id), self.plan.port_base, self.plan.port_span
        if step == 0:
            return int(self.job.env.get("MASTER_PORT") or base + job % span)
        return base + (job + step * 7919) % span
