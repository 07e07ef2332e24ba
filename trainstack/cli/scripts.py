"""``trainstack generate`` and ``submit``: a job's script rendered, written or submitted (also over ssh, and across
clusters). Never imports torch."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from .._common import envvars
from .._slurm.options import build_spec
from .._slurm.plan import driver_note
from ..render import LaunchSpec, render
from .base import EPILOG, PROGRAM_FIRST, ProgramCommand, forwarded_args, given, main, remote_call, spec_options


@main.command(cls=ProgramCommand, epilog=EPILOG, context_settings=PROGRAM_FIRST)
@spec_options
@click.option("--explain", is_flag=True, help="Annotate why each line is there and say the job's plan in words.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write here instead of stdout.")
@click.option("--force", is_flag=True, help="Overwrite --output if it exists.")
@click.option("--dry-run", is_flag=True, help="Print the script (the default without -o).")
@click.pass_context
def generate(ctx: click.Context, output: str | None, force: bool, dry_run: bool, **params: Any) -> None:
    """Render one sbatch script; the program and its arguments follow `--`."""
    spec, templates_dir = build_spec(params, given(ctx), say=lambda line: click.echo(line, err=True))
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
@spec_options
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
    from .._launch.backend import backend
    from .._slurm.options import load_profile

    if clusters:
        from .follow import follow_command

        sys.exit(follow_command(ctx, clusters, store, move_cost, hedge))
    site = load_profile(params["profile"]) if params.get("profile") else {}  # read once, here
    if site.get("slurm_conf") and not (host or site.get("host")):  # a second Slurm reachable from this machine
        os.environ["SLURM_CONF"] = str(site["slurm_conf"])
    if not host and site and not os.environ.get(envvars.REMOTE_SIDE):  # a site profile may name the login node
        host = site.get("host")
        if ctx.get_parameter_source("remote_dir") is ParameterSource.DEFAULT:
            remote_dir = site.get("remote_dir", remote_dir)
    if host:
        from .._slurm.hosted import submit_hosted

        args = forwarded_args(ctx)
        sys.exit(remote_call(lambda: submit_hosted(host, remote_dir, args, Path.cwd())))

    spec, templates_dir = build_spec(params, given(ctx), site=site, say=lambda line: click.echo(line, err=True))
    slurm = backend()
    if test_only:
        click.echo(json.dumps(slurm.expected_start(_render(spec, templates_dir), spec)))
        return
    if dry_run:
        click.echo(_render(spec, templates_dir), nl=False)
        for line in slurm.submission_lines(spec, None):
            click.echo(line, err=True)
        return
    slurm.check(spec)
    note = driver_note(spec, shipped=True)
    if note:
        click.echo(note, err=True)
    if spec.requeue:
        click.echo("note: --requeue: cancel this job with `trainstack cancel JOB`; a plain scancel reads as a "
                   "preemption (Slurm sends both the same SIGTERM) and requeues it", err=True)
    job = slurm.submit(spec, wait=wait, templates_dir=templates_dir, command_line=_command_line(),
                       echo=lambda line: click.echo(line, nl=False), snapshot=snapshot, hold=hold, argv=sys.argv)
    if spec.tasks and not job.job_id:
        click.echo(f"all {len(spec.tasks)} tasks of this sweep already finished (in {spec.sweep_dir}); "
                   f"nothing submitted")
        return
    for line in slurm.submission_lines(spec, job):
        click.echo(line, err=True)
    held = " (held: scontrol release " + job.job_id + ")" if hold else ""
    click.echo(f"job {job.job_id}{held} folder {job.job_dir} log {job.log_path}")
    if wait:
        sys.exit(job.exit_code or 0)


def _render(spec: LaunchSpec, templates_dir: str | None) -> str:
    import jinja2

    try:
        return render(spec, templates_dir, command_line=_command_line())
    except jinja2.TemplateError as exc:  # a site template (--templates-dir) that does not render
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, jinja2.TemplateSyntaxError) else ""
        raise click.ClickException(f"the template could not be rendered{where}: {exc.message}. HINT: fix the "
                                   f"site template, or drop --templates-dir to use the shipped one.") from None


def _write_output(path: Path, text: str, force: bool) -> None:
    from .._common.files import atomic_write

    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder; give a file name", param_hint="'-o'")
    if path.exists() and not force:
        raise click.BadParameter(f"{path} exists; pass --force to overwrite it", param_hint="'-o'")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text, mode=0o755)  # executable; never a partial script
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


