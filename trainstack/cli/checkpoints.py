"""``trainstack checkpoint ...``: free a job's memory checkpoints, stage, inspect, consolidate and export
checkpoints (the checkpoint door is imported inside each command: ``generate`` never loads torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from .base import hosted, main


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
    from .._common.files import url_scheme

    if not url_scheme(path) and not Path(path).exists():
        raise click.BadParameter(f"{path!r} does not exist here (with --host it is read on the login node)",
                                 param_hint="'PATH'")


@checkpoint.command("free-memory")
@click.argument("job_id")
@click.option("--wait", "wait_s", type=click.IntRange(1, 3600), default=60, show_default=True,
              help="Seconds to wait for the job's nodes (srun --immediate).")
@hosted
def checkpoint_free_memory(job_id: str, wait_s: int) -> None:
    """Free the memory checkpoints an ended job left in its nodes' /dev/shm (a plain scancel of a --requeue job, a
    lost batch host, a kill -9): a one-task step on each of its nodes removes that job's folders only."""
    from .._launch.backend import backend

    hosts, folders = backend().free_memory(job_id, wait_s)
    if not folders:
        click.echo(f"job {job_id}: no memory checkpoints recorded as left (freed at its end, or it kept none)")
        return
    click.echo(f"freed {len(folders)} memory checkpoint folder(s) of job {job_id} on {', '.join(hosts)}")


@checkpoint.command("stage")
@click.argument("store")
@click.argument("folder", type=click.Path(file_okay=False))
@hosted
def checkpoint_stage(store: str, folder: str) -> None:
    """Download a run's newest committed checkpoint from its STORE (s3://...) into FOLDER (a cluster's scratch), so a
    job of the run that waits there starts without the download (TRAINSTACK_STAGED=FOLDER)."""
    from .._common.files import url_scheme
    from ..checkpoint import stage

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
@hosted
def checkpoint_inspect(path: str, which: str | None, as_json: bool) -> None:
    """Format, world size, epoch, step, the monitored value, parameters and size of a checkpoint (or a run folder's
    newest, best or last)."""

    from ..checkpoint import describe

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
    from ..checkpoint import atomic_save, consolidate

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
    from ..checkpoint import export

    _checkpoint_path(path)
    files = export(path, output, fmt, which, max_shard_size, force)
    size = sum(f.stat().st_size for f in files)
    click.echo(f"wrote {output}: {', '.join(f.name for f in files)} ({size / 1e6:,.1f} MB)")


