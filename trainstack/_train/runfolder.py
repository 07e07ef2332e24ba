"""The run folder (logs, metrics, checkpoints): chosen once on rank 0 (or by the launching process), shared with
every rank, and locked while a run and its workers use it, so two runs never mix their checkpoints and metrics.
``RunFolder`` is what the Trainer calls: ``claim`` (choose, refuse to overwrite, lock, clean), ``agree`` (every
rank gets the folder or the same error), ``fits`` (a resume must fit the model, checked before any process starts).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .._common import envvars as envvars
from .._common.jobfiles import JobFiles
from ..checkpoint import Checkpointer, CheckpointError, Store, check_fits, has_checkpoint
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..accelerator import Accelerator
    from ..config import TrainConfig
    from .peers import Held

__all__ = ["choose_run_folder", "RunLock", "RunFolderBusy", "auto_chosen", "refuse_to_overwrite", "RunFolder",
           "run_identity", "standalone_checkpointer", "record_config", "check_same_experiment",
           "identity_differences"]

_LOCK = ".lock"


class RunFolderBusy(ConfigError):
    """Another live run holds the folder's lock."""


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for the lifetime of a run (rank 0 holds it).

    The lock file records who holds it (host, pid, start time) for the error message of a second run. The kernel
    drops the lock when the process dies, so a killed run never leaves the folder locked.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._fh: IO[str] | None = None

    def acquire(self) -> None:
        fh = self._open()
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise RunFolderBusy(
                f"run folder {self.folder} is in use by another run ({holder}). Two runs in one folder would "
                f"overwrite each other's checkpoints and mix their metrics. HINT: give this run another log_folder "
                f"(or root_folder), or wait for the other run to finish.") from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        fh.flush()
        self._fh = fh

    def _open(self) -> IO[str]:
        """Create the folder and open its lock file, refusing a folder owned by someone else and a planted link:
        either would let another user make this run write where they choose."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            owner = self.folder.stat().st_uid
            if owner != os.getuid() and os.getuid() != 0:
                raise ConfigError(f"run folder {self.folder} belongs to uid {owner}, not to you (uid {os.getuid()}):"
                                  f" another user could replace its files. HINT: give this run a folder of your own "
                                  f"(root_folder or log_folder).")
            fd = os.open(self.folder / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConfigError(f"{self.folder / _LOCK} is a symbolic link (planted in a shared folder?): trainstack "
                                  f"will not write through it. HINT: remove it, or use a folder only you can write.") \
                    from None
            raise ConfigError(f"cannot use the run folder {self.folder}: {exc.strerror or exc}. HINT: set "
                              f"TrainConfig(root_folder=...) or log_folder to a writable folder.") from None
        return os.fdopen(fd, "a+", encoding="utf-8")

    def fileno(self) -> int:
        """The locked file's descriptor (a duplicate held by another process keeps the lock)."""
        if self._fh is None:
            raise ValueError("the run folder lock is not held")
        return self._fh.fileno()

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    @staticmethod
    def held(folder: Path) -> bool:
        """True when a live process holds the lock of ``folder``."""
        path = Path(folder) / _LOCK
        if not path.exists():
            return False
        try:
            with open(path, encoding="utf-8") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fh, fcntl.LOCK_UN)
        except OSError:
            return True
        return False


def choose_run_folder(root: Path, log_folder: Path, new_per_run: bool, resume: object,
                      environ: Mapping[str, str] | None = None,
                      accept: Callable[[Path], bool] | None = None, skip: Collection[Path] = ()) -> Path:
    """Where this run writes.

    * ``TRAINSTACK_RUN_DIR`` (set for each task of a sweep, named by its arguments) is used as given, also over a
      ``log_folder`` the script sets: that one would be shared by every task of the sweep;
    * an explicit ``log_folder`` (not ``./``) is used as given;
    * inside a Slurm job the folder is ``root/slurm-<job id>`` (``slurm-<array job>_<task>`` for an array task),
      so a requeued job finds its checkpoints;
    * a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) continues the folder its launch's first attempt chose
      (recorded in ``root/.torchrun-<run id>``), so its checkpoints and memory checkpoints are found;
    * ``resume="auto"`` reuses the newest run folder under ``root`` that holds a checkpoint, is not in use (nor in
      ``skip``) and that ``accept`` says belongs to this experiment;
    * otherwise (and always with ``create_subfolder_per_run``) a new ``root/<YYYYmmdd-HHMMSS>-<pid>`` folder.
    """
    env = os.environ if environ is None else environ
    if new_per_run:
        return _new_folder(Path(env[envvars.RUN_DIR]) if env.get(envvars.RUN_DIR) else root)
    if env.get(envvars.RUN_DIR):
        return Path(env[envvars.RUN_DIR])
    if log_folder != Path("./"):
        return log_folder
    job = env.get("SLURM_JOB_ID")
    if job:
        array = env.get("SLURM_ARRAY_TASK_ID")
        return root / (f"slurm-{env.get('SLURM_ARRAY_JOB_ID', job)}_{array}" if array else f"slurm-{job}")
    restarted = _torchrun_record(root, env)
    if restarted is not None and int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0 and restarted.is_file():
        named = Path(restarted.read_text().strip())
        if named.is_dir() and named.parent == root:
            return named
    if resume == "auto" and root.is_dir():
        candidates = [p for p in root.iterdir() if p.is_dir() and p not in skip and has_checkpoint(p)
                      and not RunLock.held(p)]
        for folder in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
            if accept is None or accept(folder):
                return folder
    return _new_folder(root)


def _torchrun_record(root: Path, env: Mapping[str, str]) -> Path | None:
    """Where a torchrun launch records the run folder its first attempt chose (None outside torchrun)."""
    run = env.get("TORCHELASTIC_RUN_ID")
    return root / f".torchrun-{re.sub(r'[^A-Za-z0-9_.-]', '_', run)[:80]}" if run else None


def remember_for_restarts(folder: Path, root: Path, log_folder: Path, new_per_run: bool,
                          environ: Mapping[str, str] | None = None) -> None:
    """Under torchrun, a folder chosen under ``root`` (not one the config or the job names) is recorded for the
    launch's restarts, which then continue it (``choose_run_folder``)."""
    env = os.environ if environ is None else environ
    record = _torchrun_record(root, env)
    if record is None or new_per_run or log_folder != Path("./") or env.get("SLURM_JOB_ID") or \
            env.get(envvars.RUN_DIR) or folder.parent != root:
        return
    from .._common.files import atomic_write

    try:
        atomic_write(record, f"{folder}\n")
    except OSError:
        pass


def auto_chosen(log_folder: Path, new_per_run: bool, resume: object, environ: Mapping[str, str] | None = None) -> bool:
    """True when ``choose_run_folder`` picks among earlier runs (``resume="auto"`` with no folder named by the
    config, the job or the sweep): another run may claim the same one at the same moment."""
    env = os.environ if environ is None else environ
    return (resume == "auto" and not new_per_run and log_folder == Path("./") and not env.get(envvars.RUN_DIR)
            and not env.get("SLURM_JOB_ID"))


def _new_folder(root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = root / f"{stamp}-{os.getpid():x}"
    n = 1
    while folder.exists():
        n += 1
        folder = root / f"{stamp}-{os.getpid():x}-{n}"
    return folder


def refuse_to_overwrite(folder: Path, resume: object) -> None:
    """A fresh run (no ``resume``) in a folder that already holds another run's checkpoints would overwrite them."""
    if resume is None and has_checkpoint(folder):
        raise ConfigError(
            f"run folder {folder} already holds checkpoints of an earlier run; starting afresh there would overwrite "
            f"them. HINT: continue that run with resume='auto', or give this run another log_folder (or delete "
            f"{folder / 'checkpoints'}).")


def run_identity(config: TrainConfig, optimizer: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What makes two runs the same experiment (stored in checkpoints): the settings that change what is trained, the
    optimizer's class and hyperparameters, a sweep task's own arguments -- not the duration, cadence or layout."""
    same = ("seed", "gradient_accumulation_steps", "grad_clip_norm", "mixed_precision", "dtype", "max_batches")
    # not the strategy, world size or mesh: a sharded checkpoint resumes under DDP, FSDP or HSDP, on any count
    out: dict[str, Any] = {name: repr(getattr(config, name)) for name in same}
    out["optimizer"] = type(optimizer).__name__
    groups = getattr(optimizer, "param_groups", None) or []
    out["hyperparameters"] = [repr({k: v for k, v in g.items() if k not in ("params", "initial_lr") and isinstance(
        v, (int, float, str, bool, tuple, type(None)))}) for g in groups]
    swept = (os.environ if environ is None else environ).get(envvars.SWEEP_ARGS)
    if swept:
        out["sweep"] = swept
    return out


def identity_differences(theirs: Mapping[str, Any] | None, ours: Mapping[str, Any]) -> list[str]:
    """``name: theirs -> ours`` for every setting both identities record and that differs (a checkpoint from
    before a setting was recorded is not refused for it)."""
    if not theirs:
        return []
    out = []
    for key in ours:
        if key == "hyperparameters" and theirs.get("optimizer") != ours.get("optimizer"):
            continue  # another optimizer: its hyperparameters differ by name, the class says it all
        if key in theirs and theirs[key] != ours[key]:
            if key == "hyperparameters" and len(theirs[key]) == len(ours[key]):
                for i, (a, b) in enumerate(zip(theirs[key], ours[key], strict=True)):
                    out += [f"param group {i} {k}: {v} -> {w}" for k, v, w in _dict_changes(a, b)]
            else:
                out.append(f"{key}: {theirs[key]} -> {ours[key]}")
    return out


def _dict_changes(a: str, b: str) -> list[tuple[str, Any, Any]]:
    """The keys whose values differ between two ``repr``-ed dicts of plain values."""
    import ast

    try:
        left, right = ast.literal_eval(a), ast.literal_eval(b)
    except (ValueError, SyntaxError):
        return [("hyperparameters", a, b)]
    return [(k, left.get(k), right.get(k)) for k in sorted(set(left) | set(right)) if left.get(k) != right.get(k)]


def check_same_experiment(theirs: Mapping[str, Any] | None, ours: Mapping[str, Any], where: Path) -> None:
    """A resume must continue the same experiment: a checkpoint written with another seed, optimizer hyperparameters
    or swept values is refused, naming both values."""
    differ = identity_differences(theirs, ours)
    if differ:
        raise ConfigError(f"{where} was written by another experiment: {'; '.join(differ)} (checkpoint -> this run). "
                          f"Resuming it would silently continue that run with this run's name. HINT: give this run "
                          f"its own log_folder (or root_folder with resume='auto', which passes over other "
                          f"experiments), or resume with the settings it was written with.")


def _record_in_job(folder: Path) -> None:
    """In a trainstack job, ``<job folder>/run-folder`` names the run folder (``trainstack fetch --what run``)."""
    job = JobFiles.current()
    if job is not None and job.folder.is_dir():
        try:
            job.write_run_folder(folder)
        except OSError:
            pass  # a read-only job folder must not stop the run


_RUN_ID = re.compile(r"[0-9a-f]{16}")


def valid_run_id(value: Any) -> bool:
    """An id trainstack made (16 hex digits): safe in a tracker's run name, a file name, a query."""
    return isinstance(value, str) and bool(_RUN_ID.fullmatch(value))


def ensure_run_id(folder: Path, echo: Callable[[str], None] = print) -> tuple[str, str]:
    """The run's id and how it was found: ``kept`` (``run.json``, made at the run's first start and the same on
    every restart), ``new`` (no usable ``run.json``: a checkpoint's id may take its place) or ``copied`` (the folder
    was copied from another run's: a new id, so the copy never writes into the original's tracker runs). The
    trackers resume the run it names."""
    from .._common.files import atomic_write

    path = folder / "run.json"
    here, state = str(Path(folder).resolve()), "new"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        found = data.get("run_id")
        if valid_run_id(found) and data.get("path") in (None, here):
            if data.get("path") is None:  # from before the path was recorded
                atomic_write(path, json.dumps({**data, "path": here}) + "\n", mode=0o644)
            return found, "kept"
        if valid_run_id(found):
            state = "copied"
            echo(f"trainstack: {folder} is a copy of the run in {data.get('path')}: it gets a run id of its own, so "
                 f"its trackers never write into that run's.")
        else:
            echo(f"trainstack: WARNING: {path} holds no usable run id ({str(found)[:40]!r}); a new one is made.")
    except (OSError, ValueError, AttributeError):
        pass
    run_id = uuid.uuid4().hex[:16]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"run_id": run_id, "created": time.time(), "path": here}) + "\n", mode=0o644)
    return run_id, state


@dataclass(frozen=True)
class Claim:
    """What the launching process hands the workers of one ``fit()`` about its run folder: the folder it claimed
    (None: rank 0 claims it), the folder an earlier ``fit()`` of the same Trainer trained in and this one continues
    (None: a new run), and that run's experiment identity."""

    path: Path | None = None
    continuing: Path | None = None
    identity: dict[str, Any] | None = None
    held: Held | None = None  # a rank continued in place: the state of its last complete step (``peers``)


class RunFolder:
    """Choose, claim, share and release the run folder of one ``fit()``.

    ``identity`` is this experiment's (see ``run_identity``): ``resume="auto"`` choosing among earlier runs
    continues only one of the same experiment, and skips a folder another run claims at the same moment.
    ``echo`` prints on rank 0.
    """

    def __init__(self, config: TrainConfig, identity: dict[str, Any], echo: Callable[[str], None]) -> None:
        self.config, self.identity, self.echo = config, identity, echo
        self.lock: RunLock | None = None
        self.run_id: str | None = None  # set by agree()
        self.run_id_state = "kept"  # set by agree(): how run.json gave it (see ensure_run_id)

    def claim(self, continuing: Path | None = None) -> Path:
        """Pick the folder (``continuing``: a second fit's), refuse to overwrite another run's checkpoints, lock it,
        clear stale temp files. The lock is held by this object until ``release``."""
        cfg = self.config
        if cfg.checkpoint_store is not None and continuing is None:  # a store that cannot work creates no folder
            Store(cfg.checkpoint_store).check()
        racing = continuing is None and auto_chosen(cfg.log_folder, cfg.create_subfolder_per_run, cfg.resume)
        busy: list[Path] = []
        while True:
            folder = continuing if continuing is not None else choose_run_folder(
                cfg.root_folder, cfg.log_folder, cfg.create_subfolder_per_run, cfg.resume,
                accept=self._same_experiment if racing else None, skip=busy)
            if continuing is None and os.environ.get(envvars.RUN_DIR) and cfg.log_folder != Path("./") \
                    and folder != cfg.log_folder:
                self.echo(f"trainstack: sweep task: training in its own folder {folder}, not in log_folder="
                          f"{str(cfg.log_folder)!r} (every task of the sweep would share that one).")
            if continuing is None:
                refuse_to_overwrite(folder, cfg.resume)
            lock = RunLock(folder)
            try:
                lock.acquire()
            except RunFolderBusy:
                if not racing or len(busy) > 20:
                    raise
                busy.append(folder)  # claimed by another run since we looked: take the next one
                continue
            Checkpointer(folder).remove_stale_temp_files()
            self.lock = lock
            if continuing is None:
                remember_for_restarts(folder, cfg.root_folder, cfg.log_folder, cfg.create_subfolder_per_run)
            return folder

    def launch_claim(self, here: bool, continuing: Path | None, identity: dict[str, Any] | None,
                     model: Any) -> Claim:
        """What the launching process hands its workers. ``here``: it starts rank 0 itself (spawned workers), so it
        claims the folder now -- a busy one is an error before any worker starts -- and checks that the checkpoint
        to resume fits ``model``; otherwise rank 0 claims it in its own process."""
        if not here:
            return Claim(None, continuing, identity)
        path = self.claim(continuing)
        self.fits(model, path)
        return Claim(path, continuing, identity)

    def held_fds(self) -> list[int]:
        """The lock's file descriptor while this object holds the folder (spawned workers keep a duplicate)."""
        return [self.lock.fileno()] if self.lock is not None else []

    def agree(self, accelerator: Accelerator, claimed: Path | None, continuing: Path | None = None) -> Path:
        """Collective: rank 0 claims the folder (unless its launching process did: ``claimed``) and reads (or, on
        the first start, creates) the run's id; every rank gets both, or the same error."""
        choice: tuple[str | None, str | None, str | None] = (str(claimed), None, None) if claimed is not None \
            else (None, None, None)
        if accelerator.is_main_process:
            try:
                folder = str(self.claim(continuing)) if claimed is None else str(claimed)
                run_id, state = ensure_run_id(Path(folder), self.echo)
                choice = (folder, None, f"{run_id}/{state}")
                _record_in_job(Path(folder))
            except ConfigError as exc:
                choice = (None, str(exc), None)
        folder, error, found = accelerator.broadcast(choice)
        if found:
            self.run_id, _, self.run_id_state = found.partition("/")
        if error is not None:
            raise ConfigError(error)
        return Path(folder)

    def adopt(self, run_id: str, folder: Path) -> str:
        """A checkpoint's id for a run whose ``run.json`` was lost (not copied): the trackers continue its run."""
        from .._common.files import atomic_write

        if self.run_id_state == "new" and valid_run_id(run_id) and run_id != self.run_id:
            self.run_id = run_id
            atomic_write(Path(folder) / "run.json", json.dumps({"run_id": run_id, "created": time.time(),
                                                                 "path": str(Path(folder).resolve())}) + "\n",
                         mode=0o644)
        return self.run_id or run_id

    def fits(self, model: Any, folder: Path) -> None:
        """Before spawning: the checkpoint to resume from must fit the model (a clear error here, not in a worker)."""
        resume = self.config.resume
        if resume is None:
            return
        target = Checkpointer(folder, is_main=False).readable_latest() if resume == "auto" else Path(resume)
        if target is not None and target.exists():
            check_fits(model, target)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def earlier_run(self, current: Path) -> Path | None:
        """When trainstack chose a new folder for this run under ``root_folder``: the newest other run there with a
        checkpoint of this experiment (a second Trainer on one config starts a new run; qadence continued)."""
        root = Path(self.config.root_folder)
        try:
            if current.parent.resolve() != root.resolve() or not root.is_dir():
                return None
            others = sorted((p for p in root.iterdir() if p.is_dir() and p.name != current.name
                             and has_checkpoint(p)), key=lambda p: p.stat().st_mtime, reverse=True)
        except OSError:
            return None
        return next((p for p in others[:3] if self._same_experiment(p, quiet=True)), None)

    def _same_experiment(self, folder: Path, quiet: bool = False) -> bool:
        """Whether ``folder``'s newest checkpoint was written by this experiment (one from before trainstack
        recorded it is taken as the same)."""
        try:
            found = Checkpointer(folder, is_main=False).load()
        except CheckpointError:
            return False
        differ = identity_differences(found[0].get("identity") if found else None, self.identity)
        if not differ or quiet:
            return not differ
        self.echo(f"trainstack: resume='auto' passes over {folder}: another experiment ran there "
                  f"({'; '.join(differ)}).")
        return False


def standalone_checkpointer(config: TrainConfig, run_folder: Path | None) -> tuple[Path, Checkpointer]:
    """A checkpointer for a Trainer used outside ``fit()``: its last run's folder, the config's ``log_folder``, or a
    new one (qadence's tests call the checkpoint callbacks by hand)."""
    folder = run_folder if run_folder is not None else choose_run_folder(
        config.root_folder, config.log_folder, config.create_subfolder_per_run, config.resume)
    return folder, Checkpointer(folder, config.keep_last_checkpoints)


def record_config(config: TrainConfig, folder: Path) -> Path | None:
    """Write what ran as ``config.yaml`` (``config.json`` without pyyaml) into the run folder; a failure warns."""
    try:
        import yaml  # noqa: F401

        name = "config.yaml"
    except ImportError:
        name = "config.json"
    try:
        return config.to_file(folder / name)
    except (OSError, ConfigError) as exc:
        print(f"trainstack: WARNING: could not write {folder / name}: {exc}", flush=True)
        return None
