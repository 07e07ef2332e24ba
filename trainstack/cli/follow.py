"""``submit --cluster A --cluster B --store URL``: the command's side of the follower (``_slurm/clusters.py``) --
its options checked, every profile read and checked before anything is asked, the follower's lines on stderr."""

from __future__ import annotations

import json

import click

from .base import forwarded_args

__all__ = ["follow_command"]


def follow_command(ctx: click.Context, paths: tuple[str, ...], store: str | None, move_cost: float | None,
                     hedge: bool) -> int:
    """``submit --cluster A --cluster B --store URL``: the follower keeps the run going across the clusters; its exit
    status."""
    from .._slurm.clusters import DEFAULT_MOVE_COST_S, Cluster, Follower, measured_move_cost
    from .._slurm.options import check_profile, load_profile
    from .._slurm.spec import SpecError

    if store is None or "://" not in store:
        raise click.UsageError(f"--cluster needs --store URL: the run's checkpoint store every cluster reaches "
                               f"(got {store!r}). HINT: --store s3://bucket/runs/my-run")
    if len(paths) < 2:
        raise click.UsageError("--cluster names one cluster; a run across clusters needs two or more (one cluster: "
                               "--profile)")
    for name in ("profile", "host", "dry_run", "hold"):
        if ctx.params.get(name):
            raise click.UsageError(f"--{name.replace('_', '-')} does not go with --cluster: each cluster's profile "
                                   f"names its host and options")
    profiles = {p: load_profile(p) for p in paths}
    for path, profile in profiles.items():  # every profile checked before anything is asked or submitted
        try:
            check_profile(path, profile)
        except SpecError as exc:
            raise click.BadParameter(exc.message, param_hint="'--cluster'") from None
    clusters = [Cluster.from_profile(p, profile) for p, profile in profiles.items()]
    names = [c.name for c in clusters]
    if len(set(names)) != len(names):
        raise click.UsageError(f"two --cluster profiles name the same cluster ({names}): give each a `cluster` key")
    args = forwarded_args(ctx, drop=("host", "remote_dir", "clusters", "store", "move_cost", "wait", "test_only",
                                     "profile", "hedge"))
    if move_cost is None:  # what this run's earlier moves cost, where an earlier follower recorded them
        try:
            import fsspec

            fs, root = fsspec.core.url_to_fs(store)
            move_cost = measured_move_cost(json.loads(fs.cat_file(f"{root.rstrip('/')}/run-ledger.json")))
        except (OSError, ValueError, ImportError):
            move_cost = None
        if move_cost is not None:
            click.echo(f"trainstack: a move costs ~{move_cost:.0f} s (this run's earlier moves)", err=True)
    follower = Follower(clusters, args[1:], store, lambda line: click.echo(line, err=True),
                        move_cost_s=move_cost if move_cost is not None else DEFAULT_MOVE_COST_S, hedge=hedge)
    return follower.run()
