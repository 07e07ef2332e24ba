"""Checkpoints: what one holds, how it is written (atomically), found, rotated and restored -- with or without a
Trainer.

Two formats hold the same contents. *file* (the default for DDP): one self-contained file per save,
``<run>/checkpoints/ckpt-e<epoch>-s<step>.pt`` (and ``best.pt``), written by rank 0. *sharded* (the default for
FSDP, ``._dcp``): a folder per save where every rank writes its shard of the model and optimizer, resharded
on load to any number of processes. A checkpoint holds:

* the *parts*: anything with ``state_dict``/``load_state_dict`` (model -- unwrapped, no ``module.`` prefixes --,
  optimizer, scheduler, scaler, callbacks), by name;
* the *counters* of the loop (epoch, global step, the position inside a stopped epoch, ...);
* every rank's RNG states (gathered: saving is a collective) and the config.

A file appears under its final name only once complete (temp file + fsync + rename), so a crash, a SIGKILL or a
full disk mid-write never leaves a half-written checkpoint where ``Checkpointer.latest`` would pick it up. Files
hold only tensors and plain values: ``torch.load(path, weights_only=True)`` works.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._checkpoint.export import check_exportable, export_model
from ._checkpoint.failures import why_failed
from ._checkpoint.memformat import laid_out, staged
from ._checkpoint.parts import Restored, load_parts, model_config, state_of
from ._checkpoint.reading import (
    BEST,
    BEST_SHARDED,
    FORMAT_VERSION,
    PATTERN,
    SAVE_STATE,
    check_fits,
    checkpoint_name,
    load_file,
    periodic,
    step_of,
)
from ._checkpoint.retention import rotate
from ._checkpoint.rng import capture_rng, gather_rng, restore_rng
from ._checkpoint.sharded import load_checked as _load_shards
from ._checkpoint.store import Store, Uploads, adopt, stage
from ._common.files import TEMP_RE, create_new, fsync_path, temp_path, url_scheme
from .errors import CheckpointError, UnreadableCheckpoint

if TYPE_CHECKING:
    from ._checkpoint.memory import MemoryCheckpoints

__all__ = ["CheckpointError", "Checkpointer", "Restored", "atomic_save", "capture_rng", "restore_rng", "state_of",
           "load_parts", "staged", "laid_out",
           "checkpoint_name", "has_checkpoint", "load_file", "find", "consolidate", "describe", "load_checkpoint",
           "write_checkpoint", "Store", "Uploads", "export_model", "check_exportable", "stage", "adopt", "check_fits",
           "step_of", "SAVE_STATE", "FORMAT_VERSION"]

log = logging.getLogger(__name__)
def has_checkpoint(run_folder: str | os.PathLike) -> bool:
    """True when ``run_folder`` holds at least one complete periodic checkpoint."""
    return bool(Checkpointer(run_folder).checkpoints())


# ---------------------------------------------------------------------------------------------------- writing
def atomic_save(obj: Any, path: Path) -> float:
    """``torch.save`` to a temp file next to ``path``, fsync, then rename. Returns the seconds it took.

    Any failure becomes ``CheckpointError`` naming the cause; the temp file is removed whatever happened.
    """
    start = time.perf_counter()
    path = Path(path)
    tmp = temp_path(path)
    committed = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(create_new(tmp, 0o644), "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        committed = True
        fsync_path(path.parent)
    except Exception as exc:
        raise CheckpointError(f"could not write checkpoint {path}: {why_failed(exc, path.parent)}. The previous "
                              f"checkpoint is kept. HINT: free space or choose another root_folder/log_folder.") \
            from exc
    finally:
        if not committed:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # never let the clean-up replace the real error
                pass
    return time.perf_counter() - start


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that it disappears at once: a sharded folder is renamed to a temp name first, so a
    reader never sees it half deleted (and a kill mid-way leaves a temp folder the next run removes)."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    doomed = temp_path(path)
    try:
        os.replace(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- contents
_RESERVED = ("format_version", "rng", "world_size", "config", "model_config")


def _save_errors() -> tuple[type[BaseException], ...]:
    """What a failed save raises: DCP's CheckpointException is a BaseException (imported only when saving sharded
    checkpoints: torch.distributed.checkpoint takes seconds to import)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


class Checkpointer:
    """Save, find, rotate and restore the checkpoints of one run folder (``<run>/checkpoints``).

    Saving and restoring are collective: every rank calls them (RNG states are gathered; every rank loads).
    """

    def __init__(self, run_folder: str | os.PathLike, keep_last: int | None = None, is_main: bool = True,
                 sharded: bool = False, async_save: bool = False, uploads: Uploads | None = None) -> None:
        self.folder = Path(run_folder) / "checkpoints"
        self.uploads = uploads  # rank 0's uploads to a checkpoint store (``_checkpoint.store``), if there is one
        self.keep_last = keep_last
        self.is_main = is_main
        self.sharded = sharded
        self.async_save = async_save and sharded
        self.last_save_seconds: float | None = None  # how long training waited for the last save
        self.saved_step: int | None = None  # the global step of the newest periodic save of this run
        self._pending: Any = None  # an asynchronous sharded save in flight
        self._async_group: Any = None

    # -------------------------------------------------------------- saving
    def save(self, counters: Mapping[str, Any], parts: Mapping[str, Any], config: dict | None = None,
             best: bool = False, name: str | None = None) -> Path | None:
        """Write ``ckpt-e<epoch>-s<step>.pt`` from every part's state -- or, given a ``name`` (a callback's top-k
        file, ``best``), ``<name>.pt``, which rotation never touches. None if this periodic checkpoint was already
        saved at this step (decided from memory, identically on every rank) or on non-main ranks."""
        step = int(counters["global_step"])
        name = BEST_SHARDED if best and name is None else name
        if name is None and self.saved_step == step:
            return None
        sharded = self.sharded
        state: dict[str, Any] = {"format_version": FORMAT_VERSION, **counters}
        for part_name, part in parts.items():
            if sharded and part_name in ("model", "optimizer"):
                continue  # written as shards by every rank
            state[part_name] = state_of(part)
        if parts.get("optimizer") is not None:
            state["optimizer_class"] = type(parts["optimizer"]).__name__
        state["rng"] = gather_rng()
        state["world_size"] = len(state["rng"])
        state["config"] = config
        state["model_config"] = model_config(parts.get("model"))
        if name is None:
            self.saved_step = step
        periodic = checkpoint_name(int(counters["epoch"]), step)
        if sharded:
            return self._save_sharded(state, parts, name or periodic.removesuffix(".pt"), name is not None)
        if not self.is_main:
            return None
        return self.write(state, f"{name}.pt" if name else periodic)

    def _save_sharded(self, state: dict[str, Any], parts: Mapping[str, Any], name: str, named: bool) -> Path | None:
        """Every rank writes its shard; asynchronously (only staging stalls training) when asked, except for named
        checkpoints (best, top-k), which are linked to as soon as they exist."""
        from ._checkpoint import sharded as _dcp

        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        group = None
        if self.async_save and not named and dist.is_available() and dist.is_initialized():
            if self._async_group is None:  # collectives of the background save must not share training's group
                self._async_group = dist.new_group(backend="gloo")
            group = self._async_group
        try:
            out = _dcp.write(self.folder / name, parts.get("model"), parts.get("optimizer"), state, self.is_main,
                             group)
        except _save_errors() as exc:  # DCP's CheckpointException is a BaseException
            self._failed_save(self.folder / name, exc)
        self.last_save_seconds = time.perf_counter() - start
        if isinstance(out, _dcp.Pending):
            self._pending = out
            return None
        self._committed(named, out)
        return out if self.is_main else None

    def wait(self) -> Path | None:
        """Finish an asynchronous save in flight (collective: every rank calls it); its path on rank 0. An upload to
        the checkpoint store is never waited for here: training does not wait for the store."""
        if self._pending is None:
            return None
        from ._checkpoint import sharded as _dcp

        pending, self._pending = self._pending, None
        try:
            path = _dcp.finish(pending, self.is_main)
        except _save_errors() as exc:
            self._failed_save(pending.final, exc)
        self._committed(False, pending.final)
        return path if self.is_main else None

    def _failed_save(self, final: Path, exc: BaseException) -> None:
        """A sharded save failed on some rank: remove its temp folder (a full disk stays full otherwise) and say
        why in words."""
        from ._checkpoint import sharded as _dcp

        if self.is_main:
            shutil.rmtree(_dcp.temp_name(final), ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {why_failed(exc, self.folder)}. The previous "
                              f"checkpoint is kept. HINT: free space or choose another root_folder/log_folder.") \
            from (exc if isinstance(exc, Exception) else None)

    def _committed(self, named: bool, path: Path) -> None:
        if self.is_main and not named:
            self._rotate()
            if self.uploads is not None:
                self.uploads.submit(path)

    def write(self, state: Mapping[str, Any], name: str) -> Path:
        """Write one prepared state atomically under ``name`` (this process only), then rotate."""
        path = self.folder / name
        self.last_save_seconds = atomic_save(dict(state), path)
        if PATTERN.match(name):
            self._committed(False, path)
        return path

    # -------------------------------------------------------------- other names: best, last, top-k
    def named(self, name: str) -> Path | None:
        """The checkpoint saved under ``name`` (a file ``name.pt`` or a sharded folder), if there is one."""
        from ._checkpoint.aliases import alias_path

        return alias_path(self.folder, name)

    def link(self, target: str | Path, alias: str) -> Path | None:
        """Rank 0: make ``alias`` (``best``, ``last``) another name of the checkpoint ``target`` (a name or path)."""
        from ._checkpoint.aliases import link

        src = self.named(target) if isinstance(target, str) else Path(target)
        if not self.is_main or src is None:
            return None
        return link(src, self.folder / (alias if src.is_dir() else f"{alias}.pt"))

    def remove(self, name: str) -> None:
        """Rank 0: delete the named checkpoint (a top-k file that fell out)."""
        path = self.named(name)
        if self.is_main and path is not None:
            remove_checkpoint(path)

    def resolve(self, which: str | os.PathLike | None) -> Path | None:
        """``"best"``, ``"last"`` (the ``last`` alias, else the newest readable checkpoint), a path, or None (the
        newest readable one)."""
        if which is None:
            return self.readable_latest()
        if which == "best":
            path = self.named(BEST_SHARDED)
            if path is None:
                raise CheckpointError(f"no best checkpoint in {self.folder}. HINT: ModelCheckpoint(monitor=...), "
                                      f"TrainConfig(checkpoint_best_only=True) or SaveBestCheckpoint write one.")
            return path
        if which == "last":
            return self.named("last") or self.readable_latest()
        return Path(which)

    def remove_stale_temp_files(self) -> list[Path]:
        """Delete temp files a killed writer left behind (call only while holding the run folder's lock)."""
        if not self.folder.is_dir():
            return []
        stale = [p for p in self.folder.iterdir() if TEMP_RE.match(p.name)]
        for p in stale:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return stale

    # -------------------------------------------------------------- finding
    def checkpoints(self) -> list[Path]:
        """Complete periodic checkpoints (files, and sharded folders with their commit marker), oldest first."""
        return periodic(self.folder)

    def latest(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def _rotate(self) -> None:
        """Keep the newest ``keep_last`` periodic checkpoints -- and those still going to the store."""
        rotate(self, self.keep_last, self.uploads.protected() if self.uploads is not None else ())

    def periodic_names(self) -> list[str]:
        """The complete periodic checkpoints' names, oldest first (``retention.CheckpointStorage``)."""
        return [p.name for p in self.checkpoints()]

    # -------------------------------------------------------------- restoring
    def load(self, path: str | os.PathLike | None = None) -> tuple[dict[str, Any], Path] | None:
        """The checkpoint at ``path``, or the newest readable one (None when there is none).

        When the newest file cannot be read (e.g. truncated by a copy), the previous one is used with a warning
        naming both; an explicit ``path`` never falls back.
        """
        if path is not None:
            return load_file(path), Path(path)
        for state, candidate in self._readable():
            return state, candidate
        return None

    def _readable(self) -> Iterator[tuple[dict[str, Any], Path]]:
        """Readable checkpoints, newest first; each unreadable one passed over is named in a warning."""
        failed: list[tuple[Path, CheckpointError]] = []
        for candidate in reversed(self.checkpoints()):
            try:
                state = load_file(candidate)
            except CheckpointError as exc:
                if not candidate.exists():
                    continue  # rotated away by a live run since the listing: not damaged
                failed.append((candidate, exc))
                continue
            for bad, why in failed:
                log.warning("checkpoint %s is unreadable (%s); using the previous one, %s.", bad.name, why,
                            candidate.name)
            if failed and self.is_main:
                print(f"trainstack: WARNING: checkpoint(s) {', '.join(b.name for b, _ in failed)} unreadable "
                      f"({failed[0][1]}); using the previous one, {candidate.name}.", flush=True)
            failed = []
            yield state, candidate
        if failed:
            raise CheckpointError(f"no readable checkpoint in {self.folder}: " + "; ".join(
                f"{p.name}: {e}" for p, e in failed))

    def readable_latest(self) -> Path | None:
        """The checkpoint ``resume="auto"`` would continue from (the newest readable one), or None."""
        for _, candidate in self._readable():
            return candidate
        return None

    def restore(self, parts: Mapping[str, Any], path: str | os.PathLike | None = None, rank: int = 0,
                check: Callable[[Mapping[str, Any], Path], None] | None = None) -> Restored | None:
        """Load the checkpoint (see ``load``) into ``parts`` by name; return its counters, or None if none.
        ``check(state, path)`` may refuse the checkpoint (raise) before anything is loaded.

        Works without a Trainer: ``Checkpointer(run).restore({"model": model, "optimizer": optimizer})``.
        """
        candidates = iter([(load_file(path), Path(path))]) if path is not None else self._readable()
        for state, where in candidates:
            if check is not None:
                check(state, where)
            if where.is_dir():  # sharded: model and optimizer come from the shards, resharded to this layout
                try:
                    _load_shards(where, parts, state)
                except UnreadableCheckpoint as exc:
                    if path is not None:
                        raise
                    print(f"trainstack: WARNING: {exc}; trying the previous checkpoint.", flush=True)
                    continue
            return self._restored(parts, state, where, rank)
        return None

    def _restored(self, parts: Mapping[str, Any], state: dict[str, Any], where: Path, rank: int) -> Restored:
        load_parts(parts, state, where)
        rngs = state.get("rng") or []
        counters = {k: v for k, v in state.items() if k not in _RESERVED and k not in parts}
        world = int(state.get("world_size") or len(rngs) or 1)
        return Restored(counters, rngs[rank] if rank < len(rngs) and len(rngs) == world else None, where, world)


# ---------------------------------------------------------------------------------------------------- memory
def restore_memory(memory: MemoryCheckpoints, parts: Mapping[str, Any], newer_than: int, world: int,
                   check: Callable[[Mapping[str, Any], Path], None] | None = None) -> tuple[Restored | None, list[str]]:
    """Collective: load the newest complete memory set newer than step ``newer_than`` into ``parts``; the
    ``Restored`` (None: no such set) and the copies passed over, in words."""
    from ._checkpoint.memory import restore_memory as restore

    return restore(memory, parts, newer_than, world, check, _RESERVED)


def open_memory(run_folder: Path, rank: int, world: int, model: torch.nn.Module, optimizer: Any, run_id: str = ""
                ) -> MemoryCheckpoints:
    """Collective: this rank's memory checkpoints of the run ``run_id`` in ``run_folder`` (``ConfigError`` before
    training when a node's memory file system cannot hold them; another run's sets there removed, said in
    ``stale_removed``)."""
    from ._checkpoint.memory import MemoryCheckpoints, estimate_bytes

    memory = MemoryCheckpoints.open(Path(run_folder), rank, world, estimate_bytes(model, optimizer), FORMAT_VERSION,
                                    run_id)
    memory.record_folder()
    return memory


# ---------------------------------------------------------------------------------------------------- tools
def find(path: str | os.PathLike, which: str | None = None) -> Path:
    """A checkpoint from a run folder (its newest readable one, or its ``which`` = ``best``/``last``), a
    ``checkpoints`` folder (likewise) or a checkpoint itself."""
    from ._checkpoint.sharded import is_complete

    if url_scheme(path):  # a checkpoint store (or one checkpoint in it): read from a downloaded copy
        from ._checkpoint.store import local_copy

        return local_copy(str(path), which)
    path = Path(path)
    if which is None and (path.is_file() or is_complete(path) or PATTERN.match(path.name)
                          or path.name in (BEST, BEST_SHARDED)):
        load_file(path)  # a clear error for a missing, damaged or incomplete one
        return path
    run = path.parent if path.name == "checkpoints" else path
    found = Checkpointer(run).resolve(which)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {path}. HINT: give a run folder, its checkpoints folder, "
                              f"or one ckpt-* file or folder.")
    return found


def _on_newest(path: str | os.PathLike, read: Any, which: str | None = None) -> Any:
    """``read(checkpoint)`` for the checkpoint ``path`` names; when ``path`` is a run folder whose live run rotates
    its checkpoints while we read, the new newest one is read instead."""
    from ._checkpoint.sharded import DamagedCheckpoint

    error: BaseException | None = None
    for _ in range(20):
        where: Path | None = None
        try:
            where = find(path, which)
            return read(where)
        except (OSError, DamagedCheckpoint) as exc:  # CheckpointError included
            if where is not None and (where == Path(path) or where.exists()):
                error = exc
                break  # a checkpoint that is there and cannot be read: not a rotation
            error = exc
            time.sleep(0.05)
    if isinstance(error, DamagedCheckpoint):
        raise UnreadableCheckpoint(f"checkpoint {path} is damaged: {error}") from None
    assert error is not None
    raise error


def export(path: str | os.PathLike, output: str | os.PathLike, fmt: str = "safetensors", which: str | None = None,
           max_shard_size: str = "5GB", force: bool = False) -> list[Path]:
    """Write the consolidated weights of any checkpoint (sharded by any number of processes, or a file; a run
    folder: its newest, ``which="best"``/``"last"``) as safetensors into the folder ``output`` -- shards and an
    index above ``max_shard_size`` --, or with ``fmt="hf"`` as a folder ``from_pretrained`` loads (config +
    weights; the checkpoint must come from a ``transformers`` model). Nothing is left half-written."""
    from ._checkpoint.export import check_output, write_export

    limit = check_output(Path(output), max_shard_size, force)
    state = consolidate(path, which)
    config = load_file(find(path, which)).get("model_config") if fmt == "hf" else None
    return write_export(state, Path(output), fmt, limit, max_shard_size, config, find(path, which))


def consolidate(path: str | os.PathLike, which: str | None = None) -> dict[str, torch.Tensor]:
    """The model's whole state dict (no ``module.`` prefixes) from any checkpoint, sharded or not, in one process
    (``which="best"``: a run folder's best one)."""
    from ._checkpoint import sharded as _dcp

    def read(where: Path) -> dict[str, torch.Tensor]:
        if where.is_dir():
            return _dcp.tensors(where, "model")
        state = load_file(where)  # a folder renamed away meanwhile fails here, and is retried
        return dict(state["model"])

    return _on_newest(path, read, which)


def describe(path: str | os.PathLike, which: str | None = None) -> dict[str, Any]:
    """What ``trainstack checkpoint inspect`` shows: format, written by how many processes, where in training (epoch,
    step, batch), the monitored value, size."""
    info = _on_newest(path, _describe, which)
    if url_scheme(str(path)):  # named by its URL, not by the temp copy it was read from (removed at exit)
        base, name = str(path).rstrip("/"), Path(info["checkpoint"]).name
        info["checkpoint"] = base if base.endswith(name) else f"{base}/{name}"
    return info


def _describe(where: Path) -> dict[str, Any]:
    from ._checkpoint import sharded as _dcp

    sharded = where.is_dir()  # decided once: a live run may rotate it away while we read
    file_size = 0 if sharded else where.stat().st_size  # before the (slow) load: the file may go meanwhile
    state = load_file(where)
    partial = state.get("partial_epoch") or {}
    if sharded:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = _dcp.verify(where).state_dict_metadata
        params = sum(math.prod(v.size) for k, v in meta.items()
                     if k.startswith("model.") and isinstance(v, TensorStorageMetadata))
        size = _dcp.size_on_disk(where)
    else:
        params = sum(t.numel() for t in state["model"].values())
        size = file_size
    info = {"checkpoint": str(where), "format": "sharded" if sharded else "file",
            "world_size": state.get("world_size"), "epoch": state.get("epoch"), "step": state.get("global_step"),
            "batch": state.get("global_batch", state.get("global_step")),
            "batch_in_epoch": partial.get("batch_in_epoch", 0), "samples_in_epoch": partial.get("samples_in_epoch")}
    info.update(_monitored(state))
    info.update({"parameters": params, "bytes": size, "optimizer": state.get("optimizer_class"),
                 "saved_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state["saved_at"]))
                 if state.get("saved_at") else None})
    return info


def _monitored(state: Mapping[str, Any]) -> dict[str, str]:
    """The value that chose this checkpoint (a top-k/best one) and the run's best so far, in words."""
    out = {}
    monitor, best = state.get("monitor") or {}, state.get("best") or {}
    if monitor.get("name") and monitor.get("value") is not None:
        out["monitor"] = f"{monitor['name']} = {monitor['value']:.6g} (mode {monitor.get('mode', 'min')})"
    if best.get("name") and best.get("value") is not None:
        out["best"] = f"{best['name']} = {best['value']:.6g} at step {best.get('step')}"
    return out


# ---------------------------------------------------------------------------------------------------- qadence helpers
def write_checkpoint(folder: str | os.PathLike, model: torch.nn.Module, optimizer: Any, iteration: int | str) -> Path:
    """qadence's helper for hand-written loops: save model and optimizer as ``ckpt-e<it>-s<it>.pt`` (or ``best.pt``
    for ``iteration="best"``) in ``folder/checkpoints``; one file holds both."""
    name = BEST if iteration == "best" else checkpoint_name(int(iteration), int(iteration))
    it = 0 if iteration == "best" else int(iteration)
    state = {"format_version": FORMAT_VERSION, "epoch": it, "global_step": it, "model": state_of(model),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "optimizer_class": type(optimizer).__name__ if optimizer is not None else None}
    return Checkpointer(folder).write(state, name)


def _qadence_run_folder(folder: Path) -> Path:
    """``./`` (a config's untouched ``log_folder``) without checkpoints: the newest run under ``./qml_logs``."""
    if folder.resolve() != Path.cwd().resolve() or Checkpointer(folder).checkpoints():
        return folder
    root = folder / "qml_logs"
    runs = [p for p in root.iterdir() if p.is_dir() and Checkpointer(p).checkpoints()] if root.is_dir() else []
    if not runs:
        return folder
    newest = max(runs, key=lambda p: p.stat().st_mtime)
    log.warning("load_checkpoint(%r): no checkpoints there; using the newest run's, %s (trainstack keeps "
                "config.log_folder as you set it: trainer.run_folder names the run's folder).", str(folder), newest)
    print(f"trainstack: load_checkpoint('{folder}'): no checkpoints there; loading the newest run's, {newest} "
          f"(pass trainer.run_folder to be explicit).", flush=True)
    return newest


def load_checkpoint(folder: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None,
                    model_ckpt_name: str | os.PathLike = "", opt_ckpt_name: str | os.PathLike = "",
                    device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Any, int]:
    """qadence's helper: load the newest checkpoint of ``folder`` (or ``model_ckpt_name``; the optimizer from
    ``opt_ckpt_name`` when given) into ``model``/``optimizer``; returns ``(model, optimizer, epoch)``, epoch 0 when
    the folder holds none. ``device`` is where the model ends up.

    qadence code often passes ``trainer.config.log_folder``, which qadence rewrote to the run's folder and
    trainstack never modifies (it stays ``./``): given ``./`` without checkpoints, the newest run under the default
    ``./qml_logs`` is used, with a warning naming it (``trainer.run_folder`` is the folder of a run)."""
    folder = _qadence_run_folder(Path(folder)) if not model_ckpt_name else Path(folder)
    checkpointer = Checkpointer(folder)

    def resolve(name: str | os.PathLike) -> Path:
        given = Path(name)
        return given if given.is_absolute() or given.exists() else checkpointer.folder / given

    model_path = resolve(model_ckpt_name) if model_ckpt_name else checkpointer.latest()
    if model_path is None:
        print(f"trainstack: load_checkpoint('{folder}'): no checkpoint in {checkpointer.folder.resolve()}"
              + (" nor under ./qml_logs" if folder.resolve() == Path.cwd().resolve() else "")
              + "; nothing was loaded (epoch 0). HINT: pass trainer.run_folder, the folder of the run that "
                "trained.", flush=True)
        return model, optimizer, 0
    restored = checkpointer.restore({"model": model}, model_path)
    if optimizer is not None:
        opt_path = resolve(opt_ckpt_name) if opt_ckpt_name else model_path
        checkpointer.restore({"optimizer": optimizer}, opt_path)
    model.to(device)
    return model, optimizer, int(restored.counters.get("epoch", 0)) if restored else 0
