"""The commands about jobs once submitted: ``status``, ``why``, ``logs``, ``cancel``, ``debug``, ``fetch``. Never
imports torch."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from .._common import envvars
from .._launch.backend import backend
from .base import hosted, main, remote_call


@main.command()
@click.argument("job_ids", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--limit", type=int, default=20, show_default=True, help="Without JOBID: how many past jobs.")
@click.option("--attempts", is_flag=True, help="One row per attempt of a requeued job (its verdicts.jsonl).")
@click.option("--submission", default=None, hidden=True, help="The job a submit --host token names (JSON).")
@hosted
def status(job_ids: tuple[str, ...], as_json: bool, limit: int, attempts: bool, submission: str | None) -> None:
    """State, nodes, elapsed time, restarts, progress/ETA and the last metric line of jobs (one row per array
    task); without JOBID, your queued and running jobs and the last jobs trainstack submitted. Works without Slurm
    accounting. A run's checkpoint store URL (s3://bucket/run) shows the run's attempts across clusters: where each
    ran, from which step, and which guarantee held."""
    slurm = backend()
    if submission is not None:  # submit --host lost its connection: was this token's job submitted?
        click.echo(json.dumps({"job": slurm.find_submission(submission)}))
        return
    stores = [j for j in job_ids if "://" in j]
    if stores:  # a run's checkpoint store: the run across clusters, one line per attempt
        from .._common.lease import describe

        for url in stores:
            click.echo("\n".join(describe(url)))
        job_ids = tuple(j for j in job_ids if "://" not in j)
        if not job_ids:
            return

    rows = slurm.jobs(job_ids, limit)
    if as_json:
        click.echo(json.dumps([{**vars(r), "ended": r.ended, "log": str(r.log) if r.log else None,
                                "folder": str(r.folder) if r.folder else None,
                                "progress": r.progress.as_dict() if r.progress else None} for r in rows], indent=2))
    elif rows:
        click.echo(slurm.table(rows))
        if job_ids:  # named jobs: why each ended one ended
            from .._slurm.report import attempt_rows, health_lines, retry_line

            for row in rows:
                if row.ended:
                    click.echo(f"{row.job}: {slurm.verdict(row).line()}")
                elif row.progress is not None:
                    click.echo(f"{row.job}: {row.progress.text()} (from the log line of "
                               f"{row.progress.age_s:.0f} s ago)")
                extra = attempt_rows(row.folder) if attempts else "\n".join(
                    [f"  {line}" for line in health_lines(row.folder)] + [retry_line(row.folder)]).rstrip()
                if extra:
                    click.echo(extra)
    remote = None
    if not job_ids and not as_json:
        from .._slurm.hosted import remote_table

        remote = remote_table(limit)  # jobs submitted from here with --host, on any host
        if remote:
            click.echo(("\n" if rows else "") + remote)
    problem = None if job_ids or remote else slurm.problem()
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
@hosted
def why(job_id: str, as_json: bool) -> None:
    """Why a job ended: the verdict (completed, cancelled, preempted, time limit, hang, CUDA out-of-memory, killed by
    signal 9, collective failure, node failure, a Python error on its first failing rank, unknown), the evidence
    lines from its logs and job folder, and what to do about it."""
    from .._common.goodput import format_ledger, ledger
    from .._slurm.attempt import describe, recoveries
    from .._slurm.report import attempt_contract, health, health_lines

    slurm = backend()
    for row in slurm.jobs([job_id]):
        found = slurm.verdict(row)
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
@hosted
def logs(job_id: str, rank: int | None, follow: bool, from_byte: int) -> None:
    """Print a job's combined log, or one rank's log; an array task is <job>_<task>."""
    slurm = backend()
    if follow:  # the job's exit status is the command's (a FAILED job is not a success)
        row = slurm.follow(job_id, rank, lambda text: click.echo(text, nl=False), offset=from_byte)
        click.echo(f"--- job {row.job} {row.state}", err=True)
        sys.exit(slurm.exit_status(row.state))
    with open(slurm.log(job_id, rank), encoding="utf-8", errors="replace") as fh:
        for line in fh:
            click.echo(line, nl=False)


@main.command()
@click.argument("job_id")
@hosted
def cancel(job_id: str) -> None:
    """Cancel a queued or running job (or one array task, <job>_<task>); a --requeue job is not requeued."""
    done = backend().cancel(job_id)
    click.echo(f"cancelled {', '.join(done)}")


@main.command()
@click.argument("job_id")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Give up waiting after this long (exit 124; the job goes on).")
@hosted
def wait(job_id: str, timeout: float | None) -> None:
    """Wait until a job (every task of an array) ends, releasing Slurm's hold on its requeues, and exit with its
    exit status (0: completed), as submitit's job.wait() returns it."""
    try:
        code, state = backend().wait(job_id, timeout=timeout)
    except TimeoutError:
        click.echo(f"job {job_id} has not ended within {timeout:g} s (it goes on)", err=True)
        sys.exit(124)
    click.echo(f"job {job_id} {state}")
    sys.exit(code)


@main.command()
@click.argument("job_id")
@click.option("--wait", "wait_s", type=float, default=30.0, show_default=True,
              help="Seconds to wait for the ranks' answers before falling back to py-spy.")
@hosted
def debug(job_id: str, wait_s: float) -> None:
    """Every rank's Python stacks from a running job, and a summary naming the rank that is behind (the job keeps
    running). Dumps land in the job folder, debug-<time>/rank-<r>.txt."""
    folder = backend().debug(job_id, wait_s, click.echo)
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
    from .._slurm.hosted import fetch_job

    target = Path(output) if output else None
    sys.exit(remote_call(lambda: click.echo(f"fetched {fetch_job(host, job_id, target, what)}")))


