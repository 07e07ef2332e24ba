"""`trainstack` command line: thin click layer over ``trainstack.render`` and ``trainstack.submit``.

Never imports torch (``trainstack generate`` must answer in well under a second).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from ._common import envvars as envvars
from ._common.transport import TRANSPORTS
from ._common.version import __version__
from ._slurm.options import build_spec
from ._slurm.plan import driver_note
from ._slurm.program import FORMS
from ._slurm.spec import spec_defaults
from .render import CONTAINERS, LAUNCHERS, SETUPS, LaunchSpec, SpecError, render

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


def _spec_options(fn: Any) -> Any:
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
        from .errors import TrainstackError

        try:
            return super().invoke(ctx)
        except TrainstackError as exc:
            raise click.ClickException(str(exc)) from None


def _hosted(fn: Any) -> Any:
    """``--host DEST`` (or TRAINSTACK_HOST): run this same command on DEST's login node over the user's OpenSSH."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, host: str | None, **kwargs: Any) -> Any:
        if not host:
            return fn(*args, **kwargs)
        from ._slurm.hosted import forwarded_args, run_hosted

        ctx = click.get_current_context()
        sys.exit(_remote_call(lambda: run_hosted(host, forwarded_args(ctx), follow=bool(kwargs.get("follow")))))

    return click.option("--host", envvar=envvars.HOST, default=None, metavar="DEST",
                        help="Run it on this login node over ssh (what you type after ssh; TRAINSTACK_HOST).")(wrapper)


def _remote_call(call: Any) -> int:
    """A remote call's exit status; its RemoteError as a clear message (exit 2)."""
    from ._slurm.ssh import RemoteError

    try:
        return int(call() or 0)
    except RemoteError as exc:
        click.echo(f"trainstack: {exc}", err=True)
        return 2


@click.group(cls=TrainstackGroup, epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trainstack")
def main() -> None:
    """Render, lint-clean and submit Slurm/torchrun scripts for trainstack programs."""


@main.command(cls=ProgramCommand, epilog=EPILOG, context_settings=PROGRAM_FIRST)
@_spec_options
@click.option("--explain", is_flag=True, help="Annotate why each line is there and say the job's plan in words.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write here instead of stdout.")
@click.option("--force", is_flag=True, help="Overwrite --output if it exists.")
@click.option("--dry-run", is_flag=True, help="Print the script (the default without -o).")
@click.pass_context
def generate(ctx: click.Context, output: str | None, force: bool, dry_run: bool, **params: Any) -> None:
    """Render one sbatch script; the program and its arguments follow `--`."""
    spec, templates_dir = build_spec(ctx, params)
    text = _render(spec, templates_dir)
    note = driver_note(spec, shipped=False)
    if note:
        click.echo(note, err=True)
    log_dir = Path(spec.log_dir)
    if output and not dry_run:
        _write_output(Path(output), text, force)
        click.echo(f"wrote {output}", err=True)
        if not log_dir.is_dir():  # Slurm cannot create it: a missing log folder fails the job without any log
            _make_log_dir(log_dir)
            click.echo(f"created the log folder {log_dir} (sbatch needs it to exist)", err=True)
    else:
        click.echo(text, nl=False)
        if not log_dir.is_dir():
            click.echo(f"note: the log folder {log_dir} does not exist yet; create it before sbatch "
                       f"(mkdir -p {log_dir}), or use -o FILE or `trainstack submit`, which create it.", err=True)


@main.command(cls=ProgramCommand, epilog=EPILOG, context_settings=PROGRAM_FIRST)
@_spec_options
@click.option("--wait", is_flag=True, help="Follow the log and exit with the job's exit code.")
@click.option("--snapshot/--no-snapshot", default=True, show_default=True,
              help="Inside a git repository, copy the code (uncommitted changes included) into the job folder and "
                   "run that copy, so edits made while the job waits do not change it.")
@click.option("--hold", is_flag=True, help="Submit held; start it with `scontrol release JOBID`.")
@click.option("--dry-run", is_flag=True, help="Print the script (and a sweep's task table); submit nothing.")
@click.option("--host", envvar=envvars.HOST, default=None, metavar="DEST",
              help="Submit on this login node over ssh: the working tree is shipped with rsync (incrementally) and "
                   "the job runs from that copy (TRAINSTACK_HOST).")
@click.option("--remote-dir", envvar=envvars.REMOTE_DIR, default="trainstack-remote", show_default=True,
              help="With --host: the folder on the login node (relative to its home) that holds the shipped code.")
@click.option("--cluster", "clusters", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="One run across several clusters (repeat: each a site profile -- host or slurm_conf, partition, "
                   "nodes -- for one cluster): trainstack places the run where it starts first, follows it here, "
                   "and moves it when it is preempted or waits while another cluster is free. Needs --store.")
@click.option("--store", default=None, metavar="URL",
              help="With --cluster: the run's checkpoint store, reachable from every cluster (s3://...); each "
                   "attempt takes the run's lease there and resumes from its newest committed checkpoint.")
@click.option("--move-cost", type=float, default=None, metavar="SECONDS",
              help="With --cluster: what a move costs (upload, download, start-up, a cold compile cache); default: "
                   "the run's measured moves, else 120.")
@click.option("--hedge", is_flag=True, help="With --cluster: submit to every cluster that can start the run and "
                                            "keep the job that starts first (the others are cancelled).")
@click.option("--test-only", is_flag=True, help="Print when a job would start ({\"start_in_s\": ...}, sbatch "
                                                "--test-only and the partition's state); submit nothing.")
@click.pass_context
def submit(ctx: click.Context, wait: bool, snapshot: bool, hold: bool, dry_run: bool, host: str | None,
           remote_dir: str, clusters: tuple[str, ...], store: str | None, move_cost: float | None, hedge: bool,
           test_only: bool, **params: Any) -> None:
    """Render, create the job folder, sbatch; print the job id, its folder and its log."""
    from ._slurm.options import load_profile
    from .submit import finished_tasks, submission_notes, submit_spec, task_table

    if clusters:
        from ._slurm.clusters import follow_command

        sys.exit(follow_command(ctx, clusters, store, move_cost, hedge))
    site = load_profile(params["profile"]) if params.get("profile") else {}  # read once, here
    if site.get("slurm_conf") and not (host or site.get("host")):  # a second Slurm reachable from this machine
        os.environ["SLURM_CONF"] = str(site["slurm_conf"])
    if not host and site and not os.environ.get(envvars.REMOTE_SIDE):  # a site profile may name the login node
        host = site.get("host")
        if ctx.get_parameter_source("remote_dir") is ParameterSource.DEFAULT:
            remote_dir = site.get("remote_dir", remote_dir)
    if host:
        from ._slurm.hosted import forwarded_args, submit_hosted

        args = forwarded_args(ctx)
        sys.exit(_remote_call(lambda: submit_hosted(host, remote_dir, args, Path.cwd())))

    spec, templates_dir = build_spec(ctx, params, site=site)
    if test_only:
        from .submit import expected_start

        click.echo(json.dumps(expected_start(_render(spec, templates_dir), spec.partition, spec.world_size)))
        return
    if dry_run:
        click.echo(_render(spec, templates_dir), nl=False)
        if spec.tasks:
            click.echo(task_table(spec, finished_tasks(spec)), err=True)
        return
    from ._slurm.options import check_submittable
    from .submit import sbatch_path

    sbatch_path()  # no Slurm here: that first, before what the job would find
    check_submittable(spec)
    note = driver_note(spec, shipped=True)
    if note:
        click.echo(note, err=True)
    if spec.requeue:
        click.echo("note: --requeue: cancel this job with `trainstack cancel JOB`; a plain scancel reads as a "
                   "preemption (Slurm sends both the same SIGTERM) and requeues it", err=True)
    job = submit_spec(spec, wait=wait, templates_dir=templates_dir, command_line=_command_line(),
                      echo=lambda line: click.echo(line, nl=False), snapshot=snapshot, hold=hold,
                      argv=sys.argv)
    if spec.tasks and not job.job_id:
        click.echo(f"all {len(spec.tasks)} tasks of this sweep already finished (in {spec.sweep_dir}); "
                   f"nothing submitted")
        return
    for line in submission_notes(job):
        click.echo(line, err=True)
    held = " (held: scontrol release " + job.job_id + ")" if hold else ""
    click.echo(f"job {job.job_id}{held} folder {job.job_dir} log {job.log_path}")
    if wait:
        sys.exit(job.exit_code or 0)


@main.command()
@click.argument("job_ids", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--limit", type=int, default=20, show_default=True, help="Without JOBID: how many past jobs.")
@click.option("--attempts", is_flag=True, help="One row per attempt of a requeued job (its verdicts.jsonl).")
@click.option("--submission", default=None, hidden=True, help="The job a submit --host token names (JSON).")
@_hosted
def status(job_ids: tuple[str, ...], as_json: bool, limit: int, attempts: bool, submission: str | None) -> None:
    """State, nodes, elapsed time, restarts, progress/ETA and the last metric line of jobs (one row per array
    task); without JOBID, your queued and running jobs and the last jobs trainstack submitted. Works without Slurm
    accounting. A run's checkpoint store URL (s3://bucket/run) shows the run's attempts across clusters: where each
    ran, from which step, and which guarantee held."""
    import json

    from ._slurm.status import format_table, job_status, my_jobs, slurm_problem

    if submission is not None:  # submit --host lost its connection: was this token's job submitted?
        from .submit import find_submission

        click.echo(json.dumps({"job": find_submission(submission)}))
        return
    stores = [j for j in job_ids if "://" in j]
    if stores:  # a run's checkpoint store: the run across clusters, one line per attempt
        from ._common.lease import describe

        for url in stores:
            click.echo("\n".join(describe(url)))
        job_ids = tuple(j for j in job_ids if "://" not in j)
        if not job_ids:
            return

    rows = [row for job_id in job_ids for row in job_status(job_id)] if job_ids else my_jobs(limit)
    if as_json:
        click.echo(json.dumps([{**vars(r), "ended": r.ended, "log": str(r.log) if r.log else None,
                                "folder": str(r.folder) if r.folder else None,
                                "progress": r.progress.as_dict() if r.progress else None} for r in rows], indent=2))
    elif rows:
        click.echo(format_table(rows))
        if job_ids:  # named jobs: why each ended one ended
            from ._slurm.report import attempt_rows, health_lines, retry_line
            from ._slurm.verdict import verdict

            for row in rows:
                if row.ended:
                    click.echo(f"{row.job}: {verdict(row.state, row.folder, row.log).line()}")
                elif row.progress is not None:
                    click.echo(f"{row.job}: {row.progress.text()} (from the log line of "
                               f"{row.progress.age_s:.0f} s ago)")
                extra = attempt_rows(row.folder) if attempts else "\n".join(
                    [f"  {line}" for line in health_lines(row.folder)] + [retry_line(row.folder)]).rstrip()
                if extra:
                    click.echo(extra)
    remote = None
    if not job_ids and not as_json:
        from ._slurm.hosted import remote_table

        remote = remote_table(limit)  # jobs submitted from here with --host, on any host
        if remote:
            click.echo(("\n" if rows else "") + remote)
    problem = None if job_ids or remote else slurm_problem()
    if problem:
        click.echo(f"trainstack: Slurm is not available here ({problem}): no cluster was asked"
                   + ("; the states above come from the job folders." if rows else ".")
                   + " HINT: run trainstack on the cluster's login node.", err=True)
        sys.exit(1)
    if not rows and not as_json:
        click.echo("no jobs: nothing queued or running, and trainstack submitted none yet.")


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_hosted
def why(job_id: str, as_json: bool) -> None:
    """Why a job ended: the verdict (completed, cancelled, preempted, time limit, hang, CUDA out-of-memory, killed by
    signal 9, collective failure, node failure, a Python error on its first failing rank, unknown), the evidence
    lines from its logs and job folder, and what to do about it."""
    from ._common.goodput import format_ledger, ledger
    from ._slurm.attempt import describe, recoveries
    from ._slurm.report import attempt_contract, health, health_lines
    from ._slurm.status import job_status, pending_note
    from ._slurm.verdict import verdict

    for row in job_status(job_id):
        found = verdict(row.state, row.folder, row.log)
        if row.state.startswith("PENDING"):
            note = pending_note(row.job, row.folder)
            if note:
                found.kind, found.summary = "pending", note
        recovered = recoveries(row.folder) if row.folder is not None else []
        spent = ledger(row.folder)
        contract = attempt_contract(row.log)
        if as_json:
            click.echo(json.dumps({**dataclasses.asdict(found), "recoveries": recovered, "goodput": spent,
                                   "attempt": contract, **health(row.folder)}))
            continue
        click.echo(f"job {row.job} ({row.name}): {found.line()}")
        for line in found.evidence:
            click.echo(f"  | {line}")
        if contract:
            click.echo(f"  run: {contract}")
        for line in health_lines(row.folder) + ([format_ledger(spent)] if spent else []):
            click.echo(f"  {line}")
        for recovery in recovered:
            click.echo(f"  attempt {recovery['attempt']}.{recovery['step_index']} ({recovery['cause']}): "
                       f"{describe(recovery)}")
        for hint in found.hints:
            click.echo(f"  HINT: {hint}")


@main.command()
@click.argument("job_id")
@click.option("--rank", type=int, default=None, help="This rank's own log (rank-<r>.out in the job folder).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows, until the job ends.")
@click.option("--from-byte", type=int, default=0, hidden=True, help="With --follow: start at this byte (a remote "
                                                                    "follower reconnecting).")
@_hosted
def logs(job_id: str, rank: int | None, follow: bool, from_byte: int) -> None:
    """Print a job's combined log, or one rank's log; an array task is <job>_<task>."""
    from ._slurm.status import find_log, follow_log

    if follow:
        row = follow_log(job_id, rank, echo=lambda text: click.echo(text, nl=False), offset=from_byte)
        click.echo(f"--- job {row.job} {row.state}", err=True)
        return
    path, _ = find_log(job_id, rank)
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            click.echo(line, nl=False)


@main.command()
@click.argument("job_id")
@_hosted
def cancel(job_id: str) -> None:
    """Cancel a queued or running job (or one array task, <job>_<task>); a --requeue job is not requeued."""
    from ._slurm.status import cancel_job

    done = cancel_job(job_id)
    click.echo(f"cancelled {', '.join(done)}")


def _render(spec: LaunchSpec, templates_dir: str | None) -> str:
    import jinja2

    try:
        return render(spec, templates_dir, command_line=_command_line())
    except SpecError as exc:
        raise click.BadParameter(exc.message, param_hint=f"'{exc.option}'") from None
    except jinja2.TemplateError as exc:  # a site template (--templates-dir) that does not render
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, jinja2.TemplateSyntaxError) else ""
        raise click.ClickException(f"the template could not be rendered{where}: {exc.message}. HINT: fix the "
                                   f"site template, or drop --templates-dir to use the shipped one.") from None


def _write_output(path: Path, text: str, force: bool) -> None:
    from .submit import write_script

    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder; give a file name", param_hint="'-o'")
    if path.exists() and not force:
        raise click.BadParameter(f"{path} exists; pass --force to overwrite it", param_hint="'-o'")
    try:
        write_script(path, text)
    except OSError as exc:
        raise click.BadParameter(f"cannot write {path}: {exc.strerror or exc}", param_hint="'-o'") from None


def _make_log_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create the log folder {path}: {exc.strerror or exc}",
                                 param_hint="'--log-dir'") from None


def _command_line() -> str:
    return "trainstack " + " ".join(shlex.quote(a) for a in sys.argv[1:])


@main.command()
@click.argument("job_id")
@click.option("--wait", "wait_s", type=float, default=30.0, show_default=True,
              help="Seconds to wait for the ranks' answers before falling back to py-spy.")
@_hosted
def debug(job_id: str, wait_s: float) -> None:
    """Every rank's Python stacks from a running job, and a summary naming the rank that is behind (the job keeps
    running). Dumps land in the job folder, debug-<time>/rank-<r>.txt."""
    from ._slurm.jobs import debug_job

    folder = debug_job(job_id, wait_s=wait_s, echo=click.echo)
    if folder is not None:
        click.echo(f"stacks: {folder}/rank-<r>.txt")


@main.command()
@click.argument("job_id")
@click.option("--host", envvar=envvars.HOST, required=True, metavar="DEST",
              help="The login node the job was submitted on (TRAINSTACK_HOST).")
@click.option("--what", type=click.Choice(["job", "run", "checkpoints"]), default="job", show_default=True,
              help="job: its folder (logs, rank logs, metadata, verdicts); run: its Trainer's run folder (metrics, "
                   "config, checkpoints); checkpoints: only those.")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Where to put it (default: fetched/<host>-<job>/<what>).")
def fetch(job_id: str, host: str, what: str, output: str | None) -> None:
    """Copy a job's results from the login node over rsync (incremental: run it again to update)."""
    from ._slurm.hosted import fetch_job

    target = Path(output) if output else None
    sys.exit(_remote_call(lambda: click.echo(f"fetched {fetch_job(host, job_id, target, what)}")))


@main.group()
def checkpoint() -> None:
    """Inspect checkpoints, turn them into one plain state dict, export them (safetensors, Hugging Face), free the
    memory checkpoints an ended job left."""


_WHICH = [click.option("--best", "which", flag_value="best", help="A run folder's best checkpoint (ModelCheckpoint, "
                                                                 "checkpoint_best_only)."),
          click.option("--last", "which", flag_value="last", help="A run folder's `last` checkpoint (save_last), else "
                                                                 "its newest.")]


def _which(fn: Any) -> Any:
    for option in reversed(_WHICH):
        fn = option(fn)
    return fn


def _checkpoint_path(path: str) -> None:
    """A checkpoint, run folder or checkpoint-store URL (s3://...): a local one must exist here."""
    from ._common.files import url_scheme

    if not url_scheme(path) and not Path(path).exists():
        raise click.BadParameter(f"{path!r} does not exist here (with --host it is read on the login node)",
                                 param_hint="'PATH'")


@checkpoint.command("free-memory")
@click.argument("job_id")
@click.option("--wait", "wait_s", type=click.IntRange(1, 3600), default=60, show_default=True,
              help="Seconds to wait for the job's nodes (srun --immediate).")
@_hosted
def checkpoint_free_memory(job_id: str, wait_s: int) -> None:
    """Free the memory checkpoints an ended job left in its nodes' /dev/shm (a plain scancel of a --requeue job, a
    lost batch host, a kill -9): a one-task step on each of its nodes removes that job's folders only."""
    from ._slurm.memoryfree import free_memory

    hosts, folders = free_memory(job_id, wait_s)
    if not folders:
        click.echo(f"job {job_id}: no memory checkpoints recorded as left (freed at its end, or it kept none)")
        return
    click.echo(f"freed {len(folders)} memory checkpoint folder(s) of job {job_id} on {', '.join(hosts)}")


@checkpoint.command("stage")
@click.argument("store")
@click.argument("folder", type=click.Path(file_okay=False))
@_hosted
def checkpoint_stage(store: str, folder: str) -> None:
    """Download a run's newest committed checkpoint from its STORE (s3://...) into FOLDER (a cluster's scratch), so a
    job of the run that waits there starts without the download (TRAINSTACK_STAGED=FOLDER)."""
    from ._common.files import url_scheme
    from .checkpoint import stage

    if not url_scheme(store):
        raise click.BadParameter(f"{store!r} is not a store URL (s3://bucket/run)", param_hint="'STORE'")
    try:
        name = stage(store, Path(folder))
    except OSError as exc:  # an unwritable folder, someone else's, a full disk
        raise click.ClickException(f"cannot stage into {folder}: {exc.strerror or exc}. HINT: a folder of your own "
                                   f"that you can write (a cluster's scratch).") from None
    click.echo(f"staged {name} in {folder}" if name else f"nothing to stage: {store} has no committed checkpoint")


@checkpoint.command("inspect")
@click.argument("path")
@_which
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_hosted
def checkpoint_inspect(path: str, which: str | None, as_json: bool) -> None:
    """Format, world size, epoch, step, the monitored value, parameters and size of a checkpoint (or a run folder's
    newest, best or last)."""
    import json

    from .checkpoint import describe

    _checkpoint_path(path)
    info = describe(path, which)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        click.echo(f"{key:<{width}}  {value}")


@checkpoint.command("consolidate")
@click.argument("path")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The .pt file to write.")
@_which
@click.option("--force", is_flag=True, help="Overwrite --output if it exists.")
def checkpoint_consolidate(path: str, output: str, which: str | None, force: bool) -> None:
    """Write the model's whole state dict (loadable with torch.load(..., weights_only=True) into the plain module,
    no `module.` prefixes) from any checkpoint: sharded by any number of processes, or a file (a run folder: its
    newest, --best or --last)."""
    from .checkpoint import atomic_save, consolidate

    _checkpoint_path(path)
    if Path(output).exists() and not force:
        raise click.BadParameter(f"{output} exists; pass --force to overwrite it", param_hint="'-o'")
    state = consolidate(path, which)
    atomic_save(state, Path(output))
    click.echo(f"wrote {output}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters")


@checkpoint.command("export")
@click.argument("path")
@click.option("-o", "--output", required=True, type=click.Path(), help="The folder to write (it must not exist).")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "hf"]), default="safetensors", show_default=True,
              help="safetensors: the plain module's weights; hf: a folder transformers' from_pretrained loads "
                   "(config + weights; the checkpoint of a transformers model).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Above this size the weights are split into shards with an index (model.safetensors.index.json).")
@_which
@click.option("--force", is_flag=True, help="Replace --output if it exists.")
def checkpoint_export(path: str, output: str, fmt: str, max_shard_size: str, which: str | None, force: bool) -> None:
    """Export a checkpoint's consolidated weights (sharded by any number of processes, or a file; a run folder: its
    newest, --best or --last) for inference stacks: safetensors, or a Hugging Face folder."""
    from .checkpoint import export

    _checkpoint_path(path)
    files = export(path, output, fmt, which, max_shard_size, force)
    size = sum(f.stat().st_size for f in files)
    click.echo(f"wrote {output}: {', '.join(f.name for f in files)} ({size / 1e6:,.1f} MB)")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--compute-setup", type=click.Choice(["auto", "gpu", "cpu"]), default="auto", show_default=True,
              help="What the job will ask for: 'gpu' makes a missing GPU a problem.")
@click.option("--nccl-transport", type=click.Choice(tuple(TRANSPORTS)), default=None,
              help="The NCCL network the job requires: what this host lacks for it (the library, the device, the port) "
                   "is a problem. Default: TRAINSTACK_NCCL_TRANSPORT, as a generated script sets it.")
def doctor(as_json: bool, compute_setup: str, nccl_transport: str | None) -> None:
    """Check this machine/job for what breaks distributed training; exit 1 with a fix for each problem."""
    from ._runtime.doctor import run_doctor

    sys.exit(run_doctor(as_json=as_json, compute_setup=compute_setup, nccl_transport=nccl_transport))


@main.command(name="env")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def env_cmd(as_json: bool) -> None:
    """Print versions, GPUs, launcher and NCCL settings (paste it into bug reports)."""
    from ._runtime.doctor import run_doctor

    run_doctor(as_json=as_json, report_only=True)


if __name__ == "__main__":  # pragma: no cover
    main()
