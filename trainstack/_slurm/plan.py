"""What a job's driver does, as data: ``Plan``, built from a ``LaunchSpec`` at ``generate`` time and written into
the job script itself (a heredoc the driver reads), so the script and its plan are one submission's artefact that
an admin reads together. ``explain`` says the plan in words (``trainstack generate --explain``).

The launch is decided here once, as argv words per launcher and container: the driver only adds the step's node
list and its rendezvous (``MASTER_ADDR``/``MASTER_PORT``, torchrun's ``PET_RDZV_ENDPOINT``/``PET_RDZV_ID``).
Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .._common.choices import PORT_BASE, PORT_SPAN
from .._common.version import PACKAGE, __version__, source, source_digest
from .attempt import parse_retry_on
from .jobfolder import JobPaths
from .rungs import LADDER
from .spec import MIN_STEP_SECONDS, NODE_CHECK_BUDGET_S, TEARDOWN_GRACE_S, LaunchSpec

__all__ = ["Plan", "Launch", "Recovery", "NodeCheckPlan", "Sweep", "build_plan", "FORMAT", "driver_note"]

#: The plan's format: a driver refuses a plan of a format it does not know (said, with the versions).
FORMAT = 1


@dataclass(frozen=True)
class Launch:
    """One job step's command: ``srun`` and its flags, the task wrapper's log kind, what each task runs (the
    container, the interpreter or torchrun) and the program's own words, and variables the command reads."""

    srun: list[str]
    tasks_per_node: int
    task_log: str  # rank | node | none (EXIT_RECORD_SH's first argument)
    command: list[str]
    program: list[str]
    env: dict[str, str] = field(default_factory=dict)
    torchrun: bool = False

    def python_form(self) -> tuple[list[str], list[str]] | None:
        """What a warm standby runs for this launch (``_slurm/standby.py``): the interpreter's words (a container's
        prefix kept) and the program's words as python takes them (``script ARGS`` or ``-m module ARGS``); None where
        a standby cannot become a rank (an executable, a custom launcher's command)."""
        command, program = self.command, self.program
        if self.torchrun:  # [prefix..., python, -m, torch.distributed.run, options...]: the workers' interpreter
            at = next((i for i in range(1, len(command) - 1)
                       if command[i] == "-m" and command[i + 1] == "torch.distributed.run"), None)
            if at is None or program[:1] == ["--no-python"]:
                return None
            return [*command[:at], "-u"], ["-m", *program[1:]] if program[:1] == ["--module"] else list(program)
        if self.task_log == "rank" and command[-1:] == ["-u"]:
            return list(command), list(program)
        return None

    def on(self, nodes: int, procs_per_node: int) -> Launch:
        """This launch on ``nodes`` nodes -- fewer than planned after a shrink: srun's ``--nodes``, torchrun's
        ``--nnodes`` and a custom command's machine and process counts follow (the program's words never change)."""
        def sized(words: list[str]) -> list[str]:
            return [f"{w.split('=')[0]}={nodes}" if w.startswith(("--nodes=", "--nnodes=")) else w for w in words]

        env = dict(self.env)
        if "TS_NUM_MACHINES" in env:
            env.update(TS_NUM_MACHINES=str(nodes), TS_NUM_PROCESSES=str(nodes * procs_per_node))
        return Launch(sized(self.srun), self.tasks_per_node, self.task_log, sized(self.command), self.program, env,
                      self.torchrun)


@dataclass(frozen=True)
class Recovery:
    """What happens when a step ends without finishing: retries in the allocation and requeues (``requeue``), a
    graceful stop on the stop signals (``graceful_stop``), and the policy's numbers."""

    requeue: bool = False
    graceful_stop: bool = False
    max_retries: int = 3
    max_requeues: int | None = None
    retry_on: list[str] = field(default_factory=list)
    teardown_grace_s: float = TEARDOWN_GRACE_S
    min_step_s: int = MIN_STEP_SECONDS
    min_nodes: int | None = None  # shrink: a step may run on this many of ``Plan.nodes`` when no spare is left


@dataclass(frozen=True)
class NodeCheckPlan:
    """The pre-flight node check: the command each node runs (the driver adds --out/--port/--budget), its budget
    and the site's thresholds."""

    command: list[str]
    budget_s: int = NODE_CHECK_BUDGET_S
    thresholds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Sweep:
    """A sweep's array tasks, in array order (each one's extra arguments and signature), and where they train."""

    folder: str
    tasks: list[dict[str, Any]]


@dataclass(frozen=True)
class Plan:
    """Everything the driver of one job needs, and nothing it could read from Slurm instead."""

    describe: str
    nodes: int
    spare_nodes: int
    procs_per_node: int
    gpus_per_node: int
    job_dir_prefix: str
    launch: Launch
    probe: list[str]  # the interpreter the job runs, in its container: the driver asks it for the versions
    recovery: Recovery
    node_check: NodeCheckPlan | None = None
    sweep: Sweep | None = None
    gpu: bool = False
    port_base: int = PORT_BASE
    port_span: int = PORT_SPAN
    trainstack: str = __version__
    source: str = ""  # the code that wrote the plan (version.source()): "" in a plan of an older trainstack
    format: int = FORMAT

    @property
    def allocated_nodes(self) -> int:
        return self.nodes + self.spare_nodes

    def to_json(self) -> str:
        """One top-level key per line: what an admin reads in the script."""
        data = asdict(self)
        order = ["format", "trainstack", "source", "describe", "nodes", "spare_nodes", "procs_per_node",
                 "gpus_per_node", "job_dir_prefix", "launch", "probe", "recovery", "node_check", "sweep", "gpu",
                 "port_base", "port_span"]
        return "{" + ",\n ".join(f"{json.dumps(k)}: {json.dumps(data[k])}" for k in order) + "}\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan a script carries; a ValueError naming what is wrong with it."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("the plan is not a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"the plan's format is {data.get('format')!r}, this driver (trainstack {__version__}) "
                             f"reads format {FORMAT}: generate the script with the trainstack the job runs")
        try:
            return cls(**{**data, "launch": Launch(**data["launch"]), "recovery": Recovery(**data["recovery"]),
                          "node_check": NodeCheckPlan(**data["node_check"]) if data.get("node_check") else None,
                          "sweep": Sweep(**data["sweep"]) if data.get("sweep") else None})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"the plan does not match this driver (trainstack {__version__}): {exc}") from None

    def other_source(self) -> str | None:
        """A line where the driver reading the plan runs other code than the code that wrote it (an upgrade between
        generate and the job's start, another checkout on the batch host); None where it is the same or unknown."""
        mine = f"sha256:{source_digest()}"
        if not self.source or self.source.split()[0] == mine:
            return None
        return (f"this driver runs other code than the code that wrote the job's plan: trainstack {__version__} "
                f"{mine} from {PACKAGE}, the plan's trainstack {self.trainstack} "
                f"{self.source}; it runs the plan (its format is this driver's); generate the script again with "
                f"the trainstack the job runs to pin the code it runs")

    @property
    def standbys(self) -> int:
        """Warm standbys per node where ranks train unless ``TRAINSTACK_STANDBY`` says: none without ``--requeue``
        or where a standby cannot become a rank; 1 under srun (a crash restarts one rank beside the survivors); a
        node's ranks under torchrun, whose every recovery relaunches the whole step."""
        if not self.recovery.requeue or self.launch.python_form() is None:
            return 0
        return self.procs_per_node if self.launch.torchrun else 1

    def explain(self) -> list[str]:
        """The plan in words, a line each."""
        r, lines = self.recovery, [f"{self.describe}: {self.nodes} node(s) x {self.procs_per_node} process(es)"]
        lines.append(f"each job step runs: {' '.join(self.launch.srun)} ... {' '.join(self.launch.command)} "
                     f"{' '.join(self.launch.program)}")
        if self.source:
            lines.append(f"the plan pins the code that wrote it (trainstack {self.trainstack}, {self.source}): the "
                         f"driver runs the job's own trainstack, else the copy submit ships in the job folder, and "
                         f"says in the job's log where that is other code")
        if self.node_check:
            lines.append(f"before each step every node is checked within {self.node_check.budget_s} s (compute, "
                         f"GPUs, memory, /dev/shm, job-folder writes, links); a node far below the others is named")
        if r.requeue:
            lines.append(f"a failed step's tasks are killed {r.teardown_grace_s:g} s after its first failure; its "
                         f"hosts are probed, one that does not answer is lost; then the recovery ladder, in order:")
            lines += [f"rung {i}, {rung.explain(self)}"
                      for i, rung in enumerate((x for x in LADDER if x.applies(self)), 1)]
            if self.standbys:
                lines.append(f"warm standbys: {self.standbys} per node where ranks train (a node's ranks on an idle "
                             f"spare), interpreters with torch and trainstack imported that wait to become a rank that "
                             f"must start afresh (TRAINSTACK_STANDBY in the job's environment: a count, 0 off)")
            if self.spare_nodes:
                lines.append(f"the cost of the spare: {self.spare_nodes} of the {self.allocated_nodes} allocated "
                             f"node(s) wait idle until a node fails (the price of a recovery in seconds, not a "
                             f"requeue)")
            lines += ["the driver itself: the job script's process keeps it as a child; a driver that dies (the OOM "
                      "killer, a kill) is replaced in the allocation twice, then the job is requeued",
                      *(["a sentinel (one more job step, srun --overlap) on another node watches the driver's "
                         "heartbeat and takes the driver's place in this allocation if the batch host is lost (a "
                         "requeue where it cannot); it is started again on another node if its own is lost"]
                        if self.allocated_nodes > 1 else [])]
        elif r.graceful_stop:
            lines.append("a stop signal asks the trainer to checkpoint and stop; the job is not requeued")
        else:
            lines.append("one step; its first failing task's status is the job's")
        if self.sweep:
            lines.append(f"a sweep of {len(self.sweep.tasks)} array task(s), each training in "
                         f"{self.sweep.folder}/<signature>")
        return lines


def build_plan(spec: LaunchSpec) -> Plan:
    """The plan of the job ``spec`` describes (pure)."""
    launch = _launch(spec)
    container = _container(spec)
    pyxis = _pyxis(spec)
    probe = (["srun", "--nodes=1", "--ntasks=1", *pyxis] if pyxis else container) + [spec.python]
    check = NodeCheckPlan([*pyxis, *container, spec.python, "-m", "trainstack.node_check"],
                          int(spec.node_check_thresholds.get("budget_s", NODE_CHECK_BUDGET_S)),
                          {k: float(v) for k, v in spec.node_check_thresholds.items() if k != "budget_s"}) \
        if spec.node_check_on else None
    sweep = Sweep(spec.sweep_dir, [{"args": t["args"], "signature": t["signature"]} for t in spec.tasks]) \
        if spec.tasks else None
    recovery = Recovery(spec.requeue, spec.stop_signal is not None, spec.max_retries, spec.max_requeues,
                        list(parse_retry_on(spec.retry_on)),
                        min_nodes=spec.min_nodes if spec.min_nodes != spec.nodes else None)
    kind = f"{spec.setup}, launcher {spec.launcher}" + (" (CPU, gloo)" if spec.cpu else "")
    return Plan(kind, spec.nodes, spec.spare_nodes, spec.procs, 0 if spec.cpu else spec.procs,
                JobPaths.prefix(spec.log_dir, spec.job_name), launch, probe, recovery, check, sweep, not spec.cpu,
                source=source())


def driver_note(spec: LaunchSpec, shipped: bool) -> str | None:
    """What a container job needs on its batch host (which runs the driver, outside the image), said at generate
    (``shipped`` False) and submit time; None for a job without a container (its own Python runs the driver)."""
    if spec.container == "none":
        return None
    if shipped:
        return (f"note: --container {spec.container}: the batch host runs trainstack's driver (torch-free) with its "
                f"own python3, from the copy shipped in the job folder: it needs Python 3.10+ there; where it has "
                f"none, the job runs one plain launch without in-allocation recovery and its log says so")
    return (f"note: --container {spec.container}: the batch host runs trainstack's driver (torch-free, Python 3.10+) "
            f"with its own python3, outside the image: with trainstack importable there -- or through trainstack "
            f"submit, which ships it in the job folder -- the job recovers as a bare-metal one; where neither holds, "
            f"sbatch of this script runs one plain launch WITHOUT in-allocation recovery, node checks or the job "
            f"folder's records, and its log says so")


def _pyxis(spec: LaunchSpec) -> list[str]:
    """pyxis: the image, the job's own folders mounted, run from the working folder, the home folder left out."""
    if spec.container != "pyxis":
        return []
    flags = [f"--container-image={spec.image}", "--no-container-mount-home",
             f"--container-mounts={','.join(spec.container_mounts)}"]
    return flags + ([f"--container-workdir={spec.chdir}"] if spec.chdir else [])


def _container(spec: LaunchSpec) -> list[str]:
    """apptainer: ``apptainer exec [--nv] [--bind B]... IMAGE`` before each task's command."""
    if spec.container != "apptainer":
        return []
    return ["apptainer", "exec", *([] if spec.cpu else ["--nv"]),
            *[w for b in spec.bind for w in ("--bind", b)], str(spec.image)]


def _launch(spec: LaunchSpec) -> Launch:
    per_node = spec.procs if spec.launcher == "srun" else 1
    srun = ["srun", "--kill-on-bad-exit=1", "--wait=60", f"--nodes={spec.nodes}", f"--ntasks-per-node={per_node}",
            *_pyxis(spec)]
    prefix = _container(spec)
    if spec.launcher == "custom":
        command = spec.custom_command
        for name, ref in (("num_processes", "${TS_NUM_PROCESSES}"), ("num_machines", "${TS_NUM_MACHINES}"),
                          ("machine_rank", "${SLURM_NODEID}"), ("main_process_ip", "${MASTER_ADDR}"),
                          ("main_process_port", "${MASTER_PORT}")):
            command = command.replace("{" + name + "}", ref)
        return Launch(srun, per_node, "node", [*prefix, "bash", "-c", 'eval "$CUSTOM_COMMAND"'], [],
                      {"CUSTOM_COMMAND": command, "TS_NUM_PROCESSES": str(spec.world_size),
                       "TS_NUM_MACHINES": str(spec.nodes)})
    program = spec.parsed_program
    if spec.launcher == "torchrun":
        words = {"exec": ["--no-python"], "module": ["--module"]}.get(program.kind, [])
        torchrun = [spec.python, "-m", "torch.distributed.run", f"--nnodes={spec.nodes}",
                    f"--nproc-per-node={spec.procs}", "--rdzv-backend=c10d", f"--max-restarts={spec.max_restarts}"]
        return Launch(srun, per_node, "none", [*prefix, *torchrun], [*words, *program.argv], torchrun=True)
    run = [] if program.kind == "exec" else [spec.python, "-u"]
    return Launch(srun, per_node, "rank" if spec.launcher == "srun" else "none", [*prefix, *run], list(program.words))
