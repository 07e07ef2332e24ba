"""One run's checkpoint store (``checkpoint_store``): opened and checked before training, the newest committed
checkpoint pulled when the run folder has none as new, the uploads finished a bounded time at the end. The Run
calls these; the store itself is ``trainstack.checkpoint.Store``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .._common import envvars as envvars
from .._common import lease as _lease
from .._common.choices import SHARDING
from .._common.files import url_scheme
from .._common.jobfiles import JobFiles
from ..checkpoint import Checkpointer, CheckpointError, Store, Uploads, adopt, remove_checkpoint, step_of
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["open_store", "pull_newer", "finish_uploads", "check", "run_store"]


def open_store(config: TrainConfig, path: Path, is_main: bool, kept: int | None, say: Callable[[str], None],
               world_size: int = 1) -> tuple[Store | None, Uploads | None]:
    """The run's store (its own prefix with ``create_subfolder_per_run``), checked reachable and writable on every
    rank before training; rank 0 takes the run's single-writer lease there (``trainstack._common.lease``) and
    uploads."""
    if config.checkpoint_store is None:
        return None, None
    url = config.checkpoint_store.rstrip("/") + (f"/{path.name}" if config.create_subfolder_per_run else "")
    store = Store(url)
    store.check()
    if not is_main:
        return store, None
    return store, Uploads(store, kept, say, take_lease(store, world_size, say, _config_hash(config)))


def _config_hash(config: TrainConfig) -> str:
    """A short hash of the configuration's plain fields (what the attempt trained with; not its folders)."""
    import dataclasses
    import hashlib

    def plain(value: object) -> bool:  # callables and objects print their address: not the same run to run
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        if isinstance(value, dict):
            return all(plain(v) for v in value.values())
        return value is None or isinstance(value, (str, int, float, bool))

    where = ("log_folder", "root_folder")  # each cluster's own folders: not what the run trains with
    text = repr(sorted((f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config)
                       if f.name not in where and plain(getattr(config, f.name))))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def take_lease(store: Store, world_size: int, say: Callable[[str], None],
               config_hash: str | None = None) -> _lease.Lease | None:
    """Become the run's one writer, starting its lineage at the store's newest committed checkpoint, and say what
    this attempt keeps from the one before (the portability contract). A store without conditional writes has no
    lease: said, or refused where one is required (``TRAINSTACK_LEASE=required``: runs that move between clusters)."""
    import os

    try:
        lease = store.lease(_lease.holder_here())
    except ConfigError as exc:
        if os.environ.get(envvars.LEASE) == "required":
            raise
        say(f"trainstack: note: {exc} Checkpoints are committed without a lease (one writer per run unchecked).")
        return None
    newest = store.newest()
    before = _lease.attempts(store.fs, store.root)
    now = fingerprint(world_size)
    epoch = lease.take(newest[0] if newest else None, now)
    lease.note(**provenance(config_hash))
    previous = before[-1] if before else None
    where = f" after {previous.get('cluster')} job {previous.get('job')}" if previous else ""
    say(f"trainstack: this attempt writes {store.url} as epoch {epoch}{where}: "
        f"{_lease.portability(previous.get('fingerprint') if previous else None, now)}.")
    return lease


def provenance(config_hash: str | None) -> dict[str, object]:
    """What an attempt ran besides the hardware: the image (its path and the versions it records), the code (the
    submission's git commit and whether it had uncommitted changes) and the configuration's hash."""
    import json
    import os

    image = {"path": os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")
             or os.environ.get("ENROOT_ROOTFS")}
    recorded = Path("/opt/trainstack/versions.json")
    if recorded.is_file():
        image["versions"] = json.loads(recorded.read_text())
    job = JobFiles.current()
    return {"image": image, "code": job.submitted_code() if job is not None else {}, "config_hash": config_hash}


def fingerprint(world_size: int) -> dict[str, object]:
    """What bitwise equality across attempts depends on: the GPU model, driver, CUDA, NCCL, torch and layout."""
    import os

    import torch

    cuda = torch.cuda.is_available()
    driver = None
    if cuda:
        try:
            version = getattr(torch._C, "_cuda_getDriverVersion", None)  # the CUDA driver API's version number
            driver = str(version()) if version is not None else None
        except Exception:  # noqa: BLE001 -- private API, best effort
            driver = None
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
    return {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "driver": driver,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "torch": torch.__version__, "world_size": world_size,
            "layout": f"{nodes} node(s), {world_size} process(es)"}


def pull_newer(store: Store, checkpointer: Checkpointer, is_main: bool, say: Callable[[str], None],
               lease: _lease.Lease | None = None) -> None:
    """``resume="auto"``: rank 0 downloads the store's newest committed checkpoint when the run folder has none as
    new (another machine, a lost disk); one that cannot be downloaded whole (damaged, forged, incomplete) is passed
    over for the one before it, said, as a damaged local checkpoint is."""
    if not is_main:
        return
    local = checkpointer.latest()
    for (step, _), name in reversed(store.committed()):
        if local is not None and step_of(local) >= step:
            return
        start = time.perf_counter()
        staged = os.environ.get(envvars.STAGED)
        try:
            if staged and adopt(store, name, Path(staged), checkpointer.folder, say):
                seconds = time.perf_counter() - start
                say(f"trainstack: took checkpoint {name} pre-staged in {staged} ({seconds:.1f} s, no download, "
                    f"every object's sha256 checked).")
                if lease is not None:
                    lease.note(download_s=round(seconds, 3), downloaded=name, staged=True)
                return
            got = store.download(name, checkpointer.folder)
            if got not in checkpointer.checkpoints():  # e.g. a sharded folder without its own commit marker
                remove_checkpoint(got)
                raise CheckpointError(f"{name} is not a complete {'sharded' if got.is_dir() else 'file'} checkpoint "
                                      f"once downloaded (its objects lack the commit marker a save writes)")
        except CheckpointError as exc:
            say(f"trainstack: WARNING: passing over {name} in the store: {exc}")
            continue
        seconds = time.perf_counter() - start
        say(f"trainstack: downloaded checkpoint {name} from {store.url} in {seconds:.1f} s "
            f"(the run folder had none as new).")
        if lease is not None:  # the run's ledger counts it as transfer (a move between clusters)
            lease.note(download_s=round(seconds, 3), downloaded=name)
        return


def finish_uploads(up: Uploads, failed: bool, say: Callable[[str], None]) -> None:
    """The end of the run waits five times the store timeout for the last upload, then says what it has; a writer
    another attempt took the run over from ends with ``StaleLease`` (never exit 0: a scheduler or the follower
    would read that as the run completed)."""
    bound = 5 * up.store.timeout
    if up.wait(bound) and up.stale is not None and not failed:
        raise _lease.StaleLease(f"{up.stale} Its saves after the takeover were not committed (their objects removed).")
    if not up.wait(0):
        say(f"trainstack: WARNING: the upload of {up.in_flight} to {up.store.url} did not finish within {bound:g} s "
            f"(the store does not answer?): the run ends without it; its local copy is committed, the store's "
            f"newest is {up.uploaded or 'an earlier one'}.")
    elif up.uploaded and not failed:
        skipped = f"; {up.skipped} save(s) not uploaded: a newer one replaced them while one ran" if up.skipped \
            else ""
        say(f"Checkpoints committed to {up.store.url}: newest {up.uploaded} (its upload: {up.seconds:.1f} s)"
            f"{skipped}.")


def check(config: TrainConfig) -> str | None:
    """Where the run's checkpoints come from and go, checked by their owner (``TrainConfig`` calls it): ``resume``
    a path or 'auto', a store a URL (the one a run across clusters names: returned), and what each needs."""
    if config.resume not in (None, False, "auto") and not isinstance(config.resume, (str, os.PathLike)):
        raise ConfigError(f"TrainConfig.resume={config.resume!r} must be 'auto', a checkpoint path, or None.")
    if config.export_final_model not in (None, "safetensors", "hf"):
        raise ConfigError(f"TrainConfig.export_final_model={config.export_final_model!r} must be 'safetensors', "
                          f"'hf' or None.")
    store = run_store(config.checkpoint_store, config.resume, config.create_subfolder_per_run)
    if store is not None and not url_scheme(store):
        raise ConfigError(f"TrainConfig.checkpoint_store={store!r} must be a URL such as s3://bucket/prefix. HINT: "
                          f"checkpoints already go to the run folder (log_folder/root_folder) on a local or shared "
                          f"file system.")
    if config.resume == "auto" and config.create_subfolder_per_run:
        raise ConfigError("TrainConfig.resume='auto' cannot find earlier checkpoints when "
                          "create_subfolder_per_run=True makes a new folder every time. HINT: set one of them.")
    if config.async_checkpoint and config.checkpoint_format == "file" or config.async_checkpoint and \
            config.checkpoint_format == "auto" and config.strategy not in SHARDING:
        raise ConfigError("TrainConfig.async_checkpoint=True needs sharded checkpoints: set checkpoint_format="
                          "'sharded' (or strategy='fsdp'/'hsdp').")
    return store


def run_store(configured: str | None, resume: object, subfolder_per_run: bool) -> str | None:
    """``TrainConfig.checkpoint_store`` for a run across clusters (``TRAINSTACK_CHECKPOINT_STORE``, set by ``submit
    --cluster ... --store``): that store, which the config may leave unset or name the same; every attempt must
    resume from it. Otherwise the configured value."""
    across = os.environ.get(envvars.CHECKPOINT_STORE)
    if not across:
        return configured
    if configured not in (None, across):
        raise ConfigError(f"TrainConfig.checkpoint_store={configured!r}, but this run across clusters keeps its "
                          f"checkpoints in {across!r} ({envvars.CHECKPOINT_STORE}, trainstack submit --store). HINT: "
                          f"leave checkpoint_store unset in the program.")
    if resume != "auto" or subfolder_per_run:
        raise ConfigError(f"this run moves between clusters ({envvars.CHECKPOINT_STORE}={across}), so each attempt "
                          f"must resume from the store: TrainConfig.resume={resume!r} and create_subfolder_per_run="
                          f"{subfolder_per_run!r}. HINT: resume='auto' and one fixed log_folder.")
    return across
