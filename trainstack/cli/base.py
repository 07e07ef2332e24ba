"""The command line's shared parts: the ``main`` group, the options every script command takes (one per
``LaunchSpec`` field), the program-first parsing, ``--host`` forwarding. Never imports torch."""

from __future__ import annotations

import shlex
import sys
from typing import Any

import click

from .._common import envvars as envvars
from .._common.transport import TRANSPORTS
from .._common.version import __version__
from .._slurm.program import FORMS
from .._slurm.spec import spec_defaults
from ..render import CONTAINERS, LAUNCHERS, SETUPS

DEFAULTS = spec_defaults()

EXAMPLES = """\b
Examples:
  trainstack generate --setup multi-node --nodes 2 --gpus-per-node 4 --launcher torchrun -- train.py --epochs 10
  trainstack generate --setup multi-gpu --gpus-per-node 2 --launcher srun --explain -- train.py
  trainstack generate --setup multi-node --nodes 2 --cpu --procs-per-node 2 -o job.sbatch -- examples/demo.py
  trainstack submit --setup single-gpu --time 00:30:00 --wait -- train.py
  trainstack submit --sweep lr=1e-3,1e-4 --sweep seed=0,1 --max-parallel 2 -- train.py --epochs 3
  trainstack status; trainstack logs 1234 --rank 3 --follow; trainstack cancel 1234
  trainstack doctor --compute-setup gpu
"""
EPILOG = EXAMPLES + "\n" + FORMS
#: Options come first; the first word that is not an option starts the program, and everything after it (options
#: included) belongs to the program, so `generate train.py --epochs 3` works as well as `generate -- train.py ...`.
PROGRAM_FIRST = {"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}


class ProgramCommand(click.Command):
    """A command whose trailing words are a program: records whether ``--`` separated them, and refuses
    trainstack options written after a program without it (they would silently go to the program)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["dashdash"] = "--" in args
        rest = super().parse_args(ctx, args)
        program = list(ctx.params.get("program") or ())
        if not ctx.meta["dashdash"] and len(program) > 1:
            ours = {opt for param in self.params for opt in param.opts if opt.startswith("--")}
            mixed = [w.split("=")[0] for w in program[1:] if w.split("=")[0] in ours]
            if mixed:
                raise click.UsageError(
                    f"{', '.join(dict.fromkeys(mixed))} come(s) after the program {program[0]!r}, so it would be "
                    f"passed to the program, not to trainstack. HINT: put trainstack's options before the program, "
                    f"or separate them with -- if the program takes these options itself "
                    f"(trainstack ... -- {shlex.join(program)}).", ctx=ctx)
        return rest


#: Help of the options that map onto LaunchSpec fields (their defaults come from the fields: written once).
HELP = {
    "setup": "single-gpu: one process; multi-gpu: one node, --gpus-per-node (or --procs-per-node) processes "
             "(default 2); multi-node: --nodes nodes of them.",
    "launcher": "srun: one task per process; torchrun: one agent per node; spawn: one task per node that spawns "
                "its share (python train.py --nprocs N); custom: the command after -- (or --command) with "
                "{num_processes}-style placeholders.",
    "nodes": "Nodes (multi-node: at least 2).",
    "gpus_per_node": "GPU setups: processes (GPUs) per node.",
    "cpu": "CPU-only nodes (gloo, no GPU requests).",
    "procs_per_node": "With --cpu: processes per node.",
    "cpus_per_task": "CPUs of one Slurm task (Slurm's meaning). --launcher srun runs one task per process; "
                     "torchrun/spawn/custom one task per node holding all its processes. Default: 4 per GPU "
                     "process (1 per CPU process) times the processes in a task. OMP_NUM_THREADS is this divided "
                     "by the processes in a task.",
    "mem": "Memory per node, e.g. 64G; 0 = all memory of the node.",
    "time": "Time limit (MM, HH:MM:SS, D-HH:MM...).",
    "partition": "Slurm partition (queue).", "account": "Slurm account to charge.",
    "qos": "Slurm quality of service.", "constraint": "Slurm node features, e.g. a100.",
    "nodelist": "Run on these nodes, e.g. node[1-2] (sbatch --nodelist).",
    "job_name": "Job name (the job folder is <log dir>/<name>-<job id>).",
    "log_dir": "Folder of the logs and job folders (created for you).",
    "exclusive": "Whole nodes for this job.",
    "requeue": "Checkpoint and requeue on preemption and before the time limit (with --signal, or B:USR2 120 s "
               "before it); a crash is retried when its verdict is in --retry-on, at most --max-retries times.",
    "signal": "e.g. B:USR2@300: the batch shell is told 300 s before the time limit and asks the trainer for a "
              "graceful checkpoint-and-stop (requeued only with --requeue).",
    "max_requeues": "With --requeue: a cap on time-limit requeues (default: none while each attempt gets further; "
                    "preemptions: unlimited).",
    "max_retries": "With --requeue: crashes retried at most N times (a crash not in --retry-on, or the same cause "
                   "again without progress, is not retried).",
    "retry_on": "With --requeue: the crash verdicts worth a retry, comma-separated, or all / none (see `trainstack "
                "why`).",
    "spare_nodes": "With --requeue: K more nodes than --nodes, kept in the allocation: a crash is retried as a new "
                   "job step in the same allocation, and a node the verdict blames (or that stopped answering) is "
                   "replaced by a spare -- seconds, not a requeue.",
    "min_nodes": "With --requeue: a lost or named node with no spare left continues the run on the M or more nodes "
                 "that survive, at once, at the exact sample (the global batch kept by gradient accumulation where "
                 "the world divides), instead of a requeue. Default: off (--nodes).",
    "node_check": "Check every node before training (compute, GPUs, memory, /dev/shm, job-folder writes, an "
                  "all-reduce ring): a slow or broken node is named and, with --requeue, left out (a spare takes "
                  "its place). Default: on for more than one node. Thresholds: node_check_thresholds in the "
                  "profile.",
    "env": "KEY=VALUE exported in the job (repeatable).",
    "nccl_ifname": "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME, e.g. ib0 or ^docker,lo.",
    "nccl_debug": "NCCL_DEBUG level (INFO): per-process logs in the log folder.",
    "nccl_transport": "Require NCCL's network (ib, efa, socket): a node where it is missing fails at start with the "
                      "reason (the library, the device, the port) instead of silently running on TCP sockets "
                      "(NCCL_NET is set, NCCL's init lines kept for `why`).",
    "container": "Run inside an image, keeping the Slurm environment.",
    "image": "With --container: the .sif file (apptainer) or image reference (pyxis, e.g. "
             "nvcr.io#nvidia/pytorch:25.08-py3).",
    "bind": "With --container: an extra SRC[:DST] mount (repeatable); the log folder, working folder and venv are "
            "mounted for you.",
    "venv": "Virtual environment to activate on the nodes (after --setup-cmd).",
    "setup_cmd": "Shell line run before launching, e.g. 'module load cuda' (repeatable).",
    "command": "--launcher custom: {num_processes} {num_machines} {machine_rank} {main_process_ip} "
               "{main_process_port}.",
    "max_restarts": "torchrun worker restarts.",
    "sweep": "A job array over every combination (repeatable): task i appends --KEY V to the program and trains in "
             "<log dir>/sweep-<name>/<signature of its arguments>.",
    "max_parallel": "With --sweep: at most K tasks at once.",
    "python": "The interpreter on the nodes.",
    "chdir": "Working directory of the job (default: here).",
}
_CHOICES = {"setup": SETUPS, "launcher": LAUNCHERS, "container": CONTAINERS, "nccl_transport": tuple(TRANSPORTS)}
_METAVARS = {"env": "KEY=VALUE", "sweep": "KEY=V1,V2,..."}


def _spec_option(name: str) -> Any:
    """The click option of LaunchSpec field ``name``: its default off the field, its help from ``HELP``."""
    default = DEFAULTS[name]
    flag = "--" + name.replace("_", "-")
    if name == "node_check":  # three states: on, off, or the default (more than one node)
        return click.option(f"{flag}/--no-{flag[2:]}", default=None, help=HELP[name])
    if isinstance(default, bool):
        names = [f"{flag}/--no-{flag[2:]}"] if name == "requeue" else [flag]
        return click.option(*names, is_flag=True, default=default, help=HELP[name])
    if isinstance(default, (list, dict)):
        return click.option(flag, name, multiple=True, metavar=_METAVARS.get(name), help=HELP[name])
    kind: Any = click.Choice(_CHOICES[name]) if name in _CHOICES else (int if name in _INTS else None)
    return click.option(flag, type=kind, default=default, show_default=default is not None, help=HELP[name])


_INTS = ("nodes", "gpus_per_node", "procs_per_node", "cpus_per_task", "max_requeues", "max_retries", "max_restarts",
         "max_parallel", "spare_nodes", "min_nodes")


def spec_options(fn: Any) -> Any:
    """The options shared by `generate` and `submit` (they map 1:1 onto LaunchSpec fields), then the profile and
    site templates, then the program."""
    options = [_spec_option(name) for name in HELP] + [
        click.option("--profile", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="TOML/YAML file with default option values (a site profile); flags override it."),
        click.option("--templates-dir", type=click.Path(exists=True, file_okay=False), default=None,
                     help="Site templates (slurm.sbatch.j2, _macros.j2) that override the shipped ones."),
        click.argument("program", nargs=-1, type=click.UNPROCESSED),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


class TrainstackGroup(click.Group):
    """One place where trainstack's own errors become a one-line `Error: ...` (exit 1), as hatch does: commands
    raise them and never catch them one by one. Usage errors stay click's (exit 2)."""

    def invoke(self, ctx: click.Context) -> Any:
        from .._slurm.spec import SpecError
        from ..errors import TrainstackError

        try:
            return super().invoke(ctx)
        except SpecError as exc:  # a bad option value, wherever it was found: a usage error naming it (exit 2)
            raise click.BadParameter(exc.message, param_hint=f"'{exc.option}'") from None
        except TrainstackError as exc:
            raise click.ClickException(str(exc)) from None


def given(ctx: click.Context) -> set[str]:
    """The parameters the user gave (on the command line or in the environment), not left at their defaults."""
    from click.core import ParameterSource

    return {k for k in ctx.params if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT,
                                                                           ParameterSource.DEFAULT_MAP, None)}


def forwarded_args(ctx: click.Context, drop: tuple[str, ...] = ("host", "remote_dir")) -> list[str]:
    """The command line of this click invocation, as the remote trainstack should get it (minus ``drop``)."""
    from click.core import ParameterSource

    words: list[str] = []
    node = ctx
    while node.parent is not None:  # the subcommands' names, not the program's ("python -m trainstack" is 3 words)
        words.insert(0, node.info_name or "")
        node = node.parent
    tail: list[str] = []
    for param in ctx.command.params:
        name = param.name
        if name in drop or ctx.get_parameter_source(name) is not ParameterSource.COMMANDLINE:
            continue  # only what the user typed: defaults and environment values are the remote side's own
        value = ctx.params[name]
        if isinstance(param, click.Argument):
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            tail += (["--"] if param.nargs == -1 and values else []) + [str(v) for v in values if v is not None]
        elif getattr(param, "is_flag", False):
            flag_value = getattr(param, "flag_value", None)
            if isinstance(flag_value, str):  # one of several options sharing a name (--best / --last)
                words += [param.opts[0]] if value == flag_value else []
            else:
                words += [param.opts[0]] if value else list(getattr(param, "secondary_opts", [])[:1])
        elif getattr(param, "multiple", False):
            for item in value or ():
                words += [param.opts[0], str(item)]
        elif value is not None:
            words += [param.opts[0], str(value)]
    return words + tail


def hosted(fn: Any) -> Any:
    """``--host DEST`` (or TRAINSTACK_HOST): run this same command on DEST's login node over the user's OpenSSH."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, host: str | None, **kwargs: Any) -> Any:
        if not host:
            return fn(*args, **kwargs)
        from .._slurm.hosted import run_hosted

        ctx = click.get_current_context()
        sys.exit(remote_call(lambda: run_hosted(host, forwarded_args(ctx), follow=bool(kwargs.get("follow")))))

    return click.option("--host", envvar=envvars.HOST, default=None, metavar="DEST",
                        help="Run it on this login node over ssh (what you type after ssh; TRAINSTACK_HOST).")(wrapper)


def remote_call(call: Any) -> int:
    """A remote call's exit status; its RemoteError as a clear message (exit 2)."""
    from .._slurm.ssh import RemoteError

    try:
        return int(call() or 0)
    except RemoteError as exc:
        click.echo(f"trainstack: {exc}", err=True)
        return 2


@click.group(cls=TrainstackGroup, epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trainstack")
def main() -> None:
    """Render, lint-clean and submit Slurm/torchrun scripts for trainstack programs."""


