"""``trainstack doctor`` and ``env``: what this machine or job lacks for distributed training."""

from __future__ import annotations

import sys

import click

from .._common.transport import TRANSPORTS
from .base import main


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--compute-setup", type=click.Choice(["auto", "gpu", "cpu"]), default="auto", show_default=True,
              help="What the job will ask for: 'gpu' makes a missing GPU a problem.")
@click.option("--nccl-transport", type=click.Choice(tuple(TRANSPORTS)), default=None,
              help="The NCCL network the job requires: what this host lacks for it (the library, the device, the port) "
                   "is a problem. Default: TRAINSTACK_NCCL_TRANSPORT, as a generated script sets it.")
def doctor(as_json: bool, compute_setup: str, nccl_transport: str | None) -> None:
    """Check this machine/job for what breaks distributed training; exit 1 with a fix for each problem."""
    from .._runtime.doctor import run_doctor

    sys.exit(run_doctor(as_json=as_json, compute_setup=compute_setup, nccl_transport=nccl_transport))


@main.command(name="env")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def env_cmd(as_json: bool) -> None:
    """Print versions, GPUs, launcher and NCCL settings (paste it into bug reports)."""
    from .._runtime.doctor import run_doctor

    run_doctor(as_json=as_json, report_only=True)


