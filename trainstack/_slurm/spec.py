"""What one generated job is: ``LaunchSpec``, validated when it is built, so an inconsistent request fails
before anything is written or submitted, naming the CLI option to fix. Torch-free.

Field names match the CLI options (one name from the command line to the template variable); every default is
written here once (the CLI reads them off the fields).
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from .._common.choices import PORT_BASE, PORT_SPAN
from .._common.files import url_scheme
from .._common.transport import TRANSPORTS
from .._common.transport import step_env as transport_env
from ..errors import ConfigError
from .attempt import DEFAULT_RETRY_ON
from .attempt import check_settings as check_recovery
from .jobfolder import JobPaths, safe_name
from .nodecheck import BUDGET_S as NODE_CHECK_BUDGET_S
from .nodecheck import check_settings as node_check_settings
from .program import KINDS, Program, ambiguous_for_torchrun, parse_program
from .slurmcmd import slurm_seconds
from .sweep import check_sweep, sweep_tasks

__all__ = ["LaunchSpec", "SpecError", "SETUPS", "LAUNCHERS", "CONTAINERS", "PLACEHOLDERS", "MAX_GPUS_PER_NODE",
           "DEFAULT_CPUS_PER_GPU_PROCESS", "spec_defaults"]

SETUPS = ("single-gpu", "multi-gpu", "multi-node")
LAUNCHERS = ("srun", "torchrun", "spawn", "custom")
CONTAINERS = ("none", "apptainer", "pyxis")
PLACEHOLDERS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")
MAX_GPUS_PER_NODE = 16
DEFAULT_CPUS_PER_GPU_PROCESS = 4
#: In-allocation recovery (--requeue): a step whose first task failed is killed this many seconds later if it has
#: not ended (a lost node never answers srun; its hosts are probed meanwhile); a crash is retried in the allocation
#: only with this much time left.
TEARDOWN_GRACE_S = 0.5
MIN_STEP_SECONDS = 60
_TIME = re.compile(r"\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}|UNLIMITED|INFINITE")
_UNIT_TIME = re.compile(r"\s*(?:(\d+)\s*d)?\s*(?:(\d+)\s*h)?\s*(?:(\d+)\s*m(?:in)?)?\s*(?:(\d+)\s*s)?\s*",
                        re.IGNORECASE)
_MEM = re.compile(r"\d+[KMGT]?B?", re.IGNORECASE)
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SIGNAL = re.compile(r"(B:)?(SIG)?[A-Z0-9]+(@\d+)?")
_SINGLE_LINE = ("job_name", "partition", "account", "qos", "constraint", "nodelist", "mem", "log_dir", "chdir",
                "image", "venv", "python", "nccl_ifname", "nccl_debug", "time", "signal")
_NO_LEADING_DASH = ("log_dir", "chdir", "image", "venv", "python")  # would become options of source/srun/apptainer


def _time_hint(text: str) -> str:
    """'2h', '1d12h', '90min' as people write them: the Slurm spelling to use instead."""
    m = _UNIT_TIME.fullmatch(text)
    if not m or not any(m.groups()):
        return ""
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    days, rest = divmod(total, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"; did you mean --time {f'{days}-' if days else ''}{clock}?"



class SpecError(ConfigError):
    """A launch request that cannot work; ``option`` names the CLI option to fix."""

    def __init__(self, option: str, message: str) -> None:
        self.option, self.message = option, message
        super().__init__(f"{option}: {message}")


@dataclass(frozen=True)
class LaunchSpec:
    """Everything one generated script depends on. Field names match the CLI options.

    Unset values (None) get their defaults in the derived properties (``procs``, ``stop_signal``), never by
    rewriting fields. ``program_kind`` is ``script``/``module``/``exec`` when the caller already knows it (the CLI
    asks the file system); otherwise it is read off the words.
    """

    program: list[str] = field(default_factory=list)
    setup: str = "single-gpu"
    launcher: str = "srun"
    nodes: int = 1
    gpus_per_node: int | None = None
    cpu: bool = False
    procs_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    nodelist: str | None = None
    job_name: str = "trainstack"
    log_dir: str = "logs"
    exclusive: bool = False
    requeue: bool = False
    signal: str | None = None
    max_requeues: int | None = None
    max_retries: int = 3
    retry_on: str = ",".join(DEFAULT_RETRY_ON)
    spare_nodes: int = 0
    min_nodes: int | None = None
    node_check: bool | None = None
    node_check_thresholds: dict[str, float] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    nccl_ifname: str | None = None
    nccl_debug: str | None = None
    nccl_transport: str | None = None
    container: str = "none"
    image: str | None = None
    bind: list[str] = field(default_factory=list)
    venv: str | None = None
    setup_cmd: list[str] = field(default_factory=list)
    command: str | None = None
    max_restarts: int = 0
    python: str = "python3"
    chdir: str | None = None
    explain: bool = False
    program_kind: str | None = None
    sweep: dict[str, list[str]] = field(default_factory=dict)
    max_parallel: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._check_folders()
        self._check_shape()
        self._check_resources()
        self._check_recovery()
        self._check_program()

    # ------------------------------------------------------------------ validation
    def _check_types(self) -> None:
        for name, kind in (("nodes", int), ("max_retries", int), ("max_restarts", int), ("spare_nodes", int)):
            _expect(name, getattr(self, name), kind)
        if isinstance(self.retry_on, (list, tuple)):  # a list of kinds, as a profile writes it
            object.__setattr__(self, "retry_on", ",".join(map(str, self.retry_on)))
        for name in ("gpus_per_node", "procs_per_node", "cpus_per_task", "max_requeues", "min_nodes"):
            if getattr(self, name) is not None:
                _expect(name, getattr(self, name), int)
        for name in ("cpu", "exclusive", "requeue", "explain"):
            _expect(name, getattr(self, name), bool)
        for name in ("setup", "launcher", "time", "job_name", "log_dir", "container", "python", "retry_on"):
            _expect(name, getattr(self, name), str)
        for name in ("program", "bind", "setup_cmd"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise SpecError(_opt(name), f"must be a list of strings, got {value!r}")
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in self.env.items()):
            raise SpecError("--env", f"must map names to strings, got {self.env!r}")
        if not isinstance(self.sweep, dict) or not all(
                isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
                for k, v in self.sweep.items()):
            raise SpecError("--sweep", f"must map names to lists of values, got {self.sweep!r}")
        if self.max_parallel is not None:
            _expect("max_parallel", self.max_parallel, int)

    def _check_folders(self) -> None:
        for name in ("log_dir", "chdir", "venv"):
            scheme = url_scheme(getattr(self, name))
            if scheme:
                raise SpecError(_opt(name), f"{getattr(self, name)!r} is a {scheme}:// URL; the job writes and reads "
                                            f"it as a folder on the nodes' file system (it would become a folder "
                                            f"named '{scheme}:'): give a shared file system path")

    def _check_shape(self) -> None:
        for name, allowed in (("setup", SETUPS), ("launcher", LAUNCHERS), ("container", CONTAINERS)):
            if getattr(self, name) not in allowed:
                raise SpecError(f"--{name}", f"{getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.nodes < 1:
            raise SpecError("--nodes", f"{self.nodes} is less than 1")
        if self.setup == "multi-node" and self.nodes < 2:
            raise SpecError("--nodes", f"multi-node needs at least 2 nodes, got {self.nodes}; use --setup multi-gpu "
                                       f"for one node")
        if self.setup != "multi-node" and self.nodes != 1:
            raise SpecError("--nodes", f"--setup {self.setup} runs on one node, got {self.nodes}; use --setup "
                                       f"multi-node")
        if self.cpu and self.gpus_per_node is not None:
            raise SpecError("--gpus-per-node", "cannot be combined with --cpu (CPU-only nodes, gloo)")
        if self.nccl_transport is not None and self.nccl_transport not in TRANSPORTS:
            raise SpecError("--nccl-transport", f"{self.nccl_transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.nccl_transport is not None and self.cpu:
            raise SpecError("--nccl-transport", f"{self.nccl_transport!r} is NCCL's network, and a --cpu job "
                                                f"communicates with gloo: drop one of the two")
        if not self.cpu and self.procs_per_node is not None:
            raise SpecError("--procs-per-node", "only applies with --cpu; on GPU nodes use --gpus-per-node")
        count, option = (self.procs_per_node, "--procs-per-node") if self.cpu else (self.gpus_per_node,
                                                                                    "--gpus-per-node")
        if count is not None and count < 1:
            raise SpecError(option, f"{count} is less than 1")
        if not self.cpu and not 1 <= self.procs <= MAX_GPUS_PER_NODE:
            raise SpecError("--gpus-per-node", f"{self.procs} is outside 1..{MAX_GPUS_PER_NODE}")
        if self.setup == "single-gpu" and self.procs != 1:
            raise SpecError(option, f"single-gpu runs one process, got {self.procs}; use --setup multi-gpu")

    def _check_resources(self) -> None:
        for name in _SINGLE_LINE:
            value = getattr(self, name)
            if value is not None and ("\n" in str(value) or "\r" in str(value)):
                raise SpecError(_opt(name), "must be a single line")
        if not _TIME.fullmatch(self.time):
            raise SpecError("--time", f"{self.time!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                                      f"D-HH:MM:SS or UNLIMITED){_time_hint(self.time)}")
        if self.mem is not None and not _MEM.fullmatch(self.mem):
            raise SpecError("--mem", f"{self.mem!r} is not a Slurm memory size such as 16G, 500M or 0")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise SpecError("--cpus-per-task", f"{self.cpus_per_task} is less than 1")
        if not self.job_name.strip():
            raise SpecError("--job-name", "must not be empty")
        if "/" in self.job_name:
            raise SpecError("--job-name", f"{self.job_name!r} contains '/': the log is <log dir>/<name>-<job id>.out, "
                                          f"so it would point into a folder that does not exist; use - or _")
        if not self.python.strip():
            raise SpecError("--python", "must not be empty (e.g. python3 or /path/to/venv/bin/python)")
        for name in _NO_LEADING_DASH:
            value = getattr(self, name)
            if value and str(value).startswith("-"):
                raise SpecError(_opt(name), f"{value!r} starts with '-' and would be read as an option; write "
                                            f"./{value} for a relative path")
        for key in self.env:
            if not _ENV_KEY.fullmatch(key):
                raise SpecError("--env", f"{key!r} is not a valid variable name (KEY=VALUE)")
        if self.signal is not None and not _SIGNAL.fullmatch(self.signal):
            raise SpecError("--signal", f"{self.signal!r} is not a Slurm signal spec such as B:USR2@120")
        limit = self.time_seconds
        if self.signal is not None and "@" in self.signal and limit is not None \
                and int(self.signal.rsplit("@", 1)[1]) >= limit:
            margin = self.signal.rsplit("@", 1)[1]
            raise SpecError("--signal", f"{self.signal!r} asks for the warning {margin} s before a time limit of "
                                        f"{limit} s (--time {self.time}): it would come at once. HINT: a margin of "
                                        f"about a tenth of --time, e.g. B:USR2@{max(limit // 10, 10)}")
        if self.cpus_per_task is not None and self.cpus_per_task < self.procs_per_task:
            raise SpecError("--cpus-per-task", f"{self.cpus_per_task} CPU(s) for the {self.procs_per_task} processes "
                                               f"each task runs (--launcher {self.launcher}: one task per "
                                               f"{'process' if self.launcher == 'srun' else 'node'}); give at least "
                                               f"{self.procs_per_task}")
        if self.container != "none" and not self.image:
            raise SpecError("--image", f"--container {self.container} needs --image")
        if self.container == "none" and (self.image or self.bind):
            raise SpecError("--container", "--image/--bind given without --container apptainer|pyxis")
        if self.container == "pyxis" and any("," in b for b in self.bind):
            raise SpecError("--bind", f"pyxis joins mounts with commas, so {[b for b in self.bind if ',' in b]} would "
                                      f"become several mounts; give one --bind per mount without commas")
        if self.container == "pyxis":
            for name in ("log_dir", "chdir", "venv"):
                if "," in (getattr(self, name) or "") or ":" in (getattr(self, name) or ""):
                    raise SpecError(_opt(name), f"{getattr(self, name)!r}: pyxis mounts it into the container, and "
                                                f"its mount list cannot hold a path with ',' or ':'")
        if self.max_restarts < 0:
            raise SpecError("--max-restarts", f"{self.max_restarts} is less than 0")
        if self.max_restarts and self.launcher != "torchrun":
            raise SpecError("--max-restarts", "only applies to --launcher torchrun")
        problem = check_sweep(self.sweep, self.max_parallel)
        if problem:
            raise SpecError(*problem)

    def _check_recovery(self) -> None:
        """The recovery settings, each checked by its owner: the retry policy (``attempt``), the node check's judge."""
        if self.node_check is not None:
            _expect("node_check", self.node_check, bool)
        problem = node_check_settings(self.node_check_thresholds)
        if problem:
            raise SpecError("--profile", problem)
        wrong = check_recovery(self.requeue, self.nodes, self.max_requeues, self.max_retries, self.spare_nodes,
                               self.min_nodes, self.retry_on)
        if wrong:
            raise SpecError(*wrong)

    @property
    def node_check_on(self) -> bool:
        """The pre-flight node check runs: asked for, or by default on more than one node."""
        return self.node_check if self.node_check is not None else self.nodes > 1

    def _check_program(self) -> None:
        if self.program_kind is not None and self.program_kind not in KINDS:
            raise SpecError("PROGRAM", f"program_kind={self.program_kind!r} is not one of {', '.join(KINDS)}")
        if self.launcher == "custom":
            if self.command and self.program:
                raise SpecError("--command", "give the custom command either after -- or with --command, not both "
                                             f"(the program {self.program!r} would be ignored)")
            if not (self.command or self.program):
                raise SpecError("--command", "--launcher custom needs the command after --, e.g. -- accelerate "
                                             "launch --num_processes {num_processes} ... train.py")
            unknown = set(re.findall(r"{(\w+)}", self.custom_command)) - set(PLACEHOLDERS)
            if unknown:
                raise SpecError("--command", f"unknown placeholder(s) {sorted(unknown)}; use {list(PLACEHOLDERS)}")
            return
        if self.command:
            raise SpecError("--command", "only applies to --launcher custom")
        try:
            program = self.parsed_program
        except ConfigError as exc:
            raise SpecError("PROGRAM", str(exc)) from None
        if self.launcher == "torchrun":
            words = list(program.argv[1:]) + [k if k.startswith("-") else f"--{k}" for k in self.sweep]
            for word in words:
                clash = ambiguous_for_torchrun(word)
                if clash:
                    raise SpecError("PROGRAM", f"{word.split('=')[0]!r} is an abbreviation torchrun cannot tell apart "
                                               f"from its own options ({', '.join(clash[:4])}): torchrun reads every "
                                               f"word of its command line and the job would stop at 'ambiguous "
                                               f"option'. HINT: spell the program's option out in full, or use "
                                               f"--launcher srun")

    # ------------------------------------------------------------------ derived values
    @property
    def procs(self) -> int:
        """Processes per node (default: 1 for single-gpu, else 2)."""
        given = self.procs_per_node if self.cpu else self.gpus_per_node
        return given if given is not None else (1 if self.setup == "single-gpu" else 2)

    @property
    def world_size(self) -> int:
        return self.procs * self.nodes

    @property
    def tasks_per_node(self) -> int:
        """srun mode: one Slurm task per process; every other launcher: one task per node."""
        return self.procs if self.launcher == "srun" else 1

    @property
    def procs_per_task(self) -> int:
        """Processes one Slurm task runs: 1 under srun, the node's share under torchrun/spawn/custom."""
        return 1 if self.launcher == "srun" else self.procs

    @property
    def task_cpus(self) -> int:
        """``--cpus-per-task`` (CPUs of one Slurm task), or 4 per GPU process (1 per CPU process) of the task: the
        seeds' figure, so data loading has cores and torchrun's workers are not squeezed onto one."""
        if self.cpus_per_task is not None:
            return self.cpus_per_task
        return self.procs_per_task * (1 if self.cpu else DEFAULT_CPUS_PER_GPU_PROCESS)

    @property
    def omp_threads(self) -> int:
        """Threads per process: the task's CPUs shared by the processes it runs."""
        return max(self.task_cpus // self.procs_per_task, 1)

    @property
    def time_seconds(self) -> int | None:
        """``--time`` in seconds (None: unlimited)."""
        return slurm_seconds(self.time)

    @property
    def stop_signal(self) -> str | None:
        """``--signal``, or with ``--requeue`` ``B:USR2@<margin>`` to the batch shell only: 120 s before the limit,
        at most a quarter of a short one."""
        if self.signal or not self.requeue:
            return self.signal
        limit = self.time_seconds
        return f"B:USR2@{120 if limit is None else max(min(120, limit // 4), 1)}"

    @property
    def container_mounts(self) -> list[str]:
        """pyxis: what the job needs inside the image -- the log folder (job folder, snapshot, rank logs), the
        working folder and the venv -- then the user's ``--bind`` mounts."""
        own = [f"{p}:{p}" for p in dict.fromkeys(x for x in (self.log_dir, self.chdir, self.venv) if x)]
        return own + [b for b in self.bind if b not in own]

    @functools.cached_property
    def tasks(self) -> list[dict[str, Any]]:
        """The sweep's tasks, in array order: each one's extra arguments and its stable signature (built once). What
        a task's result depends on besides its own arguments -- the program, its environment and interpreter, the
        resources it trains on -- is in its signature: a rerun that changes any of it is a new task, not a finished
        one (the code's contents are not part of it: the snapshot is taken per submission)."""
        basis = [self.program, self.command, self.env, self.python, self.venv, self.setup_cmd, self.container,
                 self.image, self.bind, self.setup, self.launcher, self.nodes, self.procs, self.cpu, self.time,
                 self.mem, self.cpus_per_task, self.partition, self.constraint, self.nodelist, self.chdir]
        return sweep_tasks(self.sweep, basis)

    @property
    def sweep_dir(self) -> str:
        """Where a sweep's tasks train: one run folder per signature, the same for every submission of it."""
        return f"{self.log_dir}/sweep-{safe_name(self.job_name)}"

    @property
    def parsed_program(self) -> Program:
        if self.program_kind is not None:
            return Program(self.program_kind, tuple(self.program[1:] if self.program_kind == "module"
                                                    and self.program[:1] == ["-m"] else self.program))
        return parse_program(self.program, self.python)

    @property
    def custom_command(self) -> str:
        """The custom launcher's command: ``--command`` as written, or the words after ``--`` shell-quoted (words
        holding placeholders stay expandable)."""
        if self.command:
            return self.command
        return " ".join(_quote_keeping_placeholders(w) for w in self.program)

    def context(self) -> dict[str, Any]:
        ctx = asdict(self)
        program = None if self.launcher == "custom" else self.parsed_program
        ctx.update(procs=self.procs, world_size=self.world_size, tasks_per_node=self.tasks_per_node,
                   allocated_nodes=self.nodes + self.spare_nodes, recovery=self.requeue,
                   teardown_grace=TEARDOWN_GRACE_S, min_step_seconds=MIN_STEP_SECONDS,
                   job_dir_prefix=JobPaths.prefix(self.log_dir, self.job_name), tasks=self.tasks,
                   sweep_dir=self.sweep_dir,
                   signal=self.stop_signal, port_base=PORT_BASE, port_span=PORT_SPAN, placeholders=PLACEHOLDERS,
                   program_kind=program.kind if program else "exec", program_words=program.words if program else [],
                   program_argv=list(program.argv) if program else [],
                   custom_command=self.custom_command if self.launcher == "custom" else "",
                   omp_threads=self.omp_threads, task_cpus=self.task_cpus, procs_per_task=self.procs_per_task,
                   container_mounts=self.container_mounts, node_check_on=self.node_check_on,
                   node_check_budget=int(self.node_check_thresholds.get("budget_s", NODE_CHECK_BUDGET_S)),
                   transport_env=transport_env(self.nccl_transport, f"{self.log_dir}/nccl.%h.%p.log",
                                               self.nccl_debug) if self.nccl_transport else {},
                   node_check_args=[word for key, value in self.node_check_thresholds.items() if key != "budget_s"
                                    for word in (f"--{key.replace('_', '-')}", f"{value:g}")])
        return ctx


def _opt(name: str) -> str:
    return "PROGRAM" if name == "program" else f"--{name.replace('_', '-')}"


def _expect(name: str, value: Any, kind: type) -> None:
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        what = {int: "an integer", bool: "true or false", str: "a string"}[kind]
        raise SpecError(_opt(name), f"must be {what}, got {value!r} ({type(value).__name__})")


def _quote_keeping_placeholders(word: str) -> str:
    """Shell-quote one word; a word holding ``{placeholder}`` goes in double quotes so the task can expand it."""
    if "{" not in word:
        return shlex.quote(word)
    return '"' + re.sub(r'(["\\$`])', r"\\\1", word) + '"'


def spec_defaults() -> dict[str, Any]:
    """Every LaunchSpec field's default, for the CLI (defaults are written once, on the fields)."""
    from dataclasses import MISSING, fields

    out: dict[str, Any] = {}
    for f in fields(LaunchSpec):
        out[f.name] = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[operator]
    return out
