"""Render Slurm sbatch scripts from the templates in ``templates/`` (pure: no I/O besides reading templates).

One :class:`LaunchSpec` dataclass is the whole rendering context; it validates itself so inconsistent
requests fail before anything is written or submitted. Every user value that reaches the shell goes through
the ``q`` filter (``shlex.quote``). Does not import torch.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .environment import PORT_BASE, PORT_SPAN

__all__ = ["LaunchSpec", "SpecError", "render", "template_dirs", "SETUPS", "LAUNCHERS", "CONTAINERS"]

SETUPS = ("single-gpu", "multi-gpu", "multi-node")
LAUNCHERS = ("srun", "torchrun", "spawn", "custom")
CONTAINERS = ("none", "apptainer", "pyxis")
PLACEHOLDERS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")
MAX_GPUS_PER_NODE = 16
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}|UNLIMITED|INFINITE)$")
_MEM = re.compile(r"^\d+[KMGT]?B?$", re.IGNORECASE)
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIGNAL = re.compile(r"^(B:)?(SIG)?[A-Z0-9]+(@\d+)?$")


class SpecError(ValueError):
    """A launch request that cannot work; ``option`` names the CLI option to fix."""

    def __init__(self, option: str, message: str) -> None:
        self.option = option
        super().__init__(f"{option}: {message}")


@dataclass
class LaunchSpec:
    """Everything one generated script depends on. Field names match the CLI options."""

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
    job_name: str = "trainstack"
    log_dir: str = "logs"
    exclusive: bool = False
    requeue: bool = False
    signal: str | None = None
    max_requeues: int = 3
    env: dict[str, str] = field(default_factory=dict)
    nccl_ifname: str | None = None
    nccl_debug: str | None = None
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

    def __post_init__(self) -> None:
        self._check_shape()
        self._check_resources()
        self._check_program()

    # ------------------------------------------------------------------ validation
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
        if self.cpu:
            if self.gpus_per_node:
                raise SpecError("--gpus-per-node", "cannot be combined with --cpu (CPU-only nodes, gloo)")
            self.procs_per_node = self.procs_per_node or (1 if self.setup == "single-gpu" else 2)
        else:
            if self.procs_per_node is not None:
                raise SpecError("--procs-per-node", "only applies with --cpu; on GPU nodes use --gpus-per-node")
            self.gpus_per_node = self.gpus_per_node or (1 if self.setup == "single-gpu" else 2)
            if not 1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE:
                raise SpecError("--gpus-per-node", f"{self.gpus_per_node} is outside 1..{MAX_GPUS_PER_NODE}")
        if self.setup == "single-gpu" and self.procs != 1:
            raise SpecError("--gpus-per-node" if not self.cpu else "--procs-per-node",
                            f"single-gpu runs one process, got {self.procs}; use --setup multi-gpu")
        if self.procs < 1:
            raise SpecError("--procs-per-node", f"{self.procs} is less than 1")

    def _check_resources(self) -> None:
        if not _TIME.match(self.time or ""):
            raise SpecError("--time", f"{self.time!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                                      f"D-HH:MM:SS or UNLIMITED)")
        if self.mem is not None and not _MEM.match(self.mem):
            raise SpecError("--mem", f"{self.mem!r} is not a Slurm memory size such as 16G, 500M or 0")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise SpecError("--cpus-per-task", f"{self.cpus_per_task} is less than 1")
        if not self.job_name:
            raise SpecError("--job-name", "must not be empty")
        for name in ("job_name", "partition", "account", "qos", "constraint", "mem", "log_dir", "chdir", "image",
                     "venv", "python", "nccl_ifname", "nccl_debug"):
            value = getattr(self, name)
            if value is not None and ("\n" in str(value) or "\r" in str(value)):
                raise SpecError(f"--{name.replace('_', '-')}", "must be a single line")
        for key in self.env:
            if not _ENV_KEY.match(key):
                raise SpecError("--env", f"{key!r} is not a valid variable name (KEY=VALUE)")
        if self.requeue and self.signal is None:
            self.signal = "B:USR2@120"  # 120 s before the time limit, to the batch shell only (see requeue_run)
        if self.signal is not None and not _SIGNAL.match(self.signal):
            raise SpecError("--signal", f"{self.signal!r} is not a Slurm signal spec such as B:USR1@90")
        if self.container != "none" and not self.image:
            raise SpecError("--image", f"--container {self.container} needs --image")
        if self.container == "none" and (self.image or self.bind):
            raise SpecError("--container", "--image/--bind given without --container apptainer|pyxis")
        if self.max_restarts < 0 or self.max_requeues < 0:
            raise SpecError("--max-restarts", "must be >= 0")
        if self.max_restarts and self.launcher != "torchrun":
            raise SpecError("--max-restarts", "only applies to --launcher torchrun")

    def _check_program(self) -> None:
        if self.launcher == "custom":
            if not self.command:
                raise SpecError("--command", "--launcher custom needs --command 'accelerate launch "
                                             "--num_processes {num_processes} ...'")
            unknown = set(re.findall(r"{(\w+)}", self.command)) - set(PLACEHOLDERS)
            if unknown:
                raise SpecError("--command", f"unknown placeholder(s) {sorted(unknown)}; use {list(PLACEHOLDERS)}")
        elif not self.program:
            raise SpecError("PROGRAM", "give the program to run after --, e.g. -- train.py --epochs 10")
        elif self.command:
            raise SpecError("--command", "only applies to --launcher custom")

    # ------------------------------------------------------------------ derived values
    @property
    def procs(self) -> int:
        """Processes per node."""
        return (self.procs_per_node if self.cpu else self.gpus_per_node) or 1

    @property
    def world_size(self) -> int:
        return self.procs * self.nodes

    @property
    def tasks_per_node(self) -> int:
        """srun mode: one Slurm task per process; every other launcher: one task per node."""
        return self.procs if self.launcher == "srun" else 1

    def context(self) -> dict[str, Any]:
        ctx = asdict(self)
        ctx.update(procs=self.procs, world_size=self.world_size, tasks_per_node=self.tasks_per_node,
                   port_base=PORT_BASE, port_span=PORT_SPAN, placeholders=PLACEHOLDERS,
                   log_dir_abs=str(Path(self.log_dir).expanduser().absolute()),
                   chdir_abs=str(Path(self.chdir or ".").expanduser().absolute()),
                   omp_threads=max((self.cpus_per_task or self.procs) // self.procs, 1))
        return ctx


def template_dirs(extra: str | Path | None = None) -> list[Path]:
    """Search order: ``--templates-dir``, the templates shipped in the wheel, the repository's ``templates/``."""
    dirs = [Path(extra)] if extra else []
    packaged = resources.files("trainstack") / "templates"
    if packaged.is_dir():
        dirs.append(Path(str(packaged)))
    repo = Path(__file__).resolve().parents[1] / "templates"
    if repo.is_dir():
        dirs.append(repo)
    return dirs


def _quote(value: Any) -> str:
    return shlex.quote(str(value))


def _always_quote(value: Any) -> str:
    """Single-quote even "safe" text (commas inside bash arrays upset shellcheck SC2054)."""
    return "'" + str(value).replace("'", "'\"'\"'") + "'"


def _sbatch_value(value: Any) -> str:
    """Values inside ``#SBATCH`` lines: sbatch splits on whitespace, so quote only when needed."""
    text = str(value)
    return text if re.match(r"^[A-Za-z0-9_.,:@%/=+-]+$", text) else '"' + text.replace('"', "'") + '"'


def render(spec: LaunchSpec, templates_dir: str | Path | None = None, command_line: str | None = None) -> str:
    """The sbatch script for ``spec`` (deterministic apart from the provenance comment)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(d) for d in template_dirs(templates_dir)]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True, autoescape=False)
    env.filters["q"] = _quote
    env.filters["sb"] = _sbatch_value
    env.filters["qq"] = _always_quote
    try:
        template = env.get_template(f"{spec.setup}.sbatch.j2")
    except jinja2.TemplateNotFound as exc:
        raise SpecError("--templates-dir",
                        f"template {exc.name!r} not found in {template_dirs(templates_dir)}") from None
    from . import __version__

    one_line = " ".join((command_line or "").split())  # a newline in a comment would start a command
    return template.render(**spec.context(), version=__version__, command_line=one_line)


def spec_matrix(**overrides: Any) -> list[LaunchSpec]:
    """One valid spec per setup x launcher x container x (GPU, CPU): what `make lint` and the tests render."""
    specs = []
    for setup in SETUPS:
        for launcher in LAUNCHERS:
            for container in CONTAINERS:
                for cpu in (False, True):
                    kw: dict[str, Any] = {"setup": setup, "launcher": launcher, "container": container, "cpu": cpu,
                                          "nodes": 2 if setup == "multi-node" else 1}
                    if container != "none":
                        image = "/images/train.sif" if container == "apptainer" else "nvcr.io#nvidia/pytorch:25.08-py3"
                        kw.update(image=image, bind=["/data:/data:ro", "/scratch"])
                    if launcher == "custom":
                        kw["command"] = ("accelerate launch --num_processes {num_processes} --num_machines "
                                         "{num_machines} --machine_rank {machine_rank} --main_process_ip "
                                         "{main_process_ip} --main_process_port {main_process_port} train.py")
                    else:
                        kw["program"] = ["train.py", "--epochs", "3"]
                    if setup != "single-gpu":
                        kw.update(requeue=True, signal="B:USR1@90", cpus_per_task=4, mem="16G")
                    specs.append(LaunchSpec(**(kw | overrides)))
    return specs
