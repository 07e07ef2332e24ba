"""Write scripts and hand them to Slurm (`sbatch`): the I/O half of the generator, behind the ``trainstack.submit``
door. A submission gets a job folder
``<log dir>/<job name>-<job id>/`` with the script, ``metadata.json`` (argv, the spec, git commit and dirty flag,
versions, submit time) and, optionally, a snapshot of the code the job runs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._common import envvars as envvars
from .._common.files import UntrustedFileError, atomic_write, deny_others_write, load_private_pickle, private_dir
from .._common.jobfiles import JobFiles
from .._common.text import number_ranges
from ..errors import TrainstackError
from ..render import render
from . import index, status
from .jobfolder import JobPaths, safe_name
from .jobs import JobError
from .snapshot import Snapshot, SnapshotError, git_root, git_state, ship_driver, take
from .spec import LaunchSpec

__all__ = ["SubmitError", "SubmittedJob", "FunctionJob", "write_script", "submit", "submit_spec", "sbatch_path",
           "find_submission", "SUBMISSION_MARK",
           "submit_function", "finished_tasks", "wait_for", "expected_start", "task_table", "submission_notes"]


class SubmitError(TrainstackError, RuntimeError):
    """sbatch is missing or refused the script."""


@dataclass
class SubmittedJob:
    """A submitted job: its id, its script and combined log, and its job folder ``<log dir>/<name>-<id>/``."""

    job_id: str
    script: Path
    log_path: Path
    job_dir: Path | None = None
    exit_code: int | None = None
    state: str | None = None
    tasks: list[int] = field(default_factory=list)  # array tasks submitted (a sweep)
    skipped: list[int] = field(default_factory=list)  # sweep tasks already finished by an earlier submission
    snapshot: Snapshot | None = None


def write_script(path: Path, text: str, mode: int = 0o755) -> Path:
    """Write atomically (temp + rename) and make it executable; a partial script never appears."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, text, mode=mode)


def sbatch_path() -> str:
    exe = shutil.which("sbatch")
    if exe is None:
        raise SubmitError("sbatch not found on PATH. HINT: run on a Slurm login node, or use `trainstack generate` "
                          "to write the script and submit it there.")
    return exe


def expected_start(script: str, partition: str | None, world_size: int | None = None) -> dict[str, Any]:
    """When a job of ``script`` would start here: ``sbatch --test-only`` (the queue and the nodes), and the
    partition's state, which ``--test-only`` does not weigh (a partition that is down starts nothing). For a run
    across clusters (``trainstack._slurm.clusters``): ``{"start_in_s": seconds or None, "reason": ...}``."""
    import tempfile

    from .clusters import parse_test_only

    exe = sbatch_path()
    sinfo = shutil.which("sinfo")
    states = subprocess.run([sinfo or "sinfo", "-h", "-o", "%P %a"], capture_output=True, text=True,
                            timeout=60).stdout.split("\n") if sinfo else []
    parts = {line.split()[0]: line.split()[1] for line in states if len(line.split()) == 2}
    name = partition or next((p.rstrip("*") for p in parts if p.endswith("*")), None)
    state = parts.get(name or "") or parts.get(f"{name}*")
    cluster = os.environ.get("SLURM_CLUSTER_NAME")
    if state is not None and state != "up":
        return {"start_in_s": None, "reason": f"partition {name} is {state}", "cluster": cluster,
                "world_size": world_size}
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as fh:
        fh.write(script)
    try:
        out = subprocess.run([exe, "--test-only", fh.name], capture_output=True, text=True, timeout=60)
    finally:
        os.unlink(fh.name)
    said = (out.stderr + out.stdout).strip()
    start = parse_test_only(said)
    return {"start_in_s": start, "reason": said.splitlines()[-1] if said else "no answer", "cluster": cluster,
            "world_size": world_size}


def task_table(spec: LaunchSpec, done: list[int]) -> str:
    """A sweep's tasks, finished or to run (``submit --dry-run``)."""
    lines = [f"{'TASK':<5} {'SIGNATURE':<13} {'STATE':<9} ARGUMENTS"]
    for i, task in enumerate(spec.tasks):
        lines.append(f"{i:<5} {task['signature']:<13} {'finished' if i in done else 'to run':<9} "
                     f"{shlex.join(task['args'])}")
    todo = len(spec.tasks) - len(done)
    lines.append(f"{todo} of {len(spec.tasks)} task(s) would run"
                 + (f", at most {spec.max_parallel} at once" if spec.max_parallel else "")
                 + f"; run folders under {spec.sweep_dir}")
    return "\n".join(lines)


def submission_notes(job: SubmittedJob) -> list[str]:
    """What a submission says beside its job id: tasks skipped, uncommitted changes run, big files linked."""
    notes = []
    if job.skipped:
        notes.append(f"skipping {len(job.skipped)} task(s) that already finished: {job.skipped}")
    if job.snapshot is not None and (job.snapshot.changed or job.snapshot.untracked):  # git asked once per submit
        names = job.snapshot.changed + job.snapshot.untracked
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        notes.append(f"warning: the job runs uncommitted changes (copied into its folder): {shown}")
    if job.snapshot is not None and job.snapshot.skipped:
        big = job.snapshot.skipped
        notes.append(f"warning: {len(big)} file(s) over 50 MB are linked into the snapshot, not copied (edits to "
                     f"them reach the job): {', '.join(big[:5])}{' ...' if len(big) > 5 else ''}")
    return notes


def finished_tasks(spec: LaunchSpec) -> list[int]:
    """Sweep tasks whose run folder says an earlier submission already ran them to the end."""
    return [i for i, task in enumerate(spec.tasks)
            if (Path(spec.sweep_dir) / task["signature"] / ".trainstack-done").exists()]


def submit_spec(spec: LaunchSpec, wait: bool = False, templates_dir: str | None = None,
                command_line: str | None = None, echo: Callable[[str], None] | None = None,
                timeout: float | None = None, snapshot: bool = False, hold: bool = False,
                argv: list[str] | None = None) -> SubmittedJob:
    """Render ``spec`` and submit it held; create its job folder (the script, ``metadata.json`` and, with
    ``snapshot``, a copy of the code the job then runs from); release it unless ``hold``. A sweep submits only the
    tasks no earlier submission finished. Everything that can fail is checked before anything is written, and the
    job folder is staged in a private folder first: a failed submission leaves no file behind."""
    exe = sbatch_path()
    text = render(spec, templates_dir, command_line)
    log_dir = Path(spec.log_dir).expanduser().resolve()
    root = git_root(Path(spec.chdir or ".")) if snapshot else None
    if root is not None:
        spec = _program_in_snapshot(spec, root)
    skipped = finished_tasks(spec)
    tasks = [i for i in range(len(spec.tasks)) if i not in skipped]
    if spec.tasks and not tasks:
        return SubmittedJob("", log_dir / "-", log_dir / "-", skipped=skipped)
    created = not log_dir.exists()
    log_dir.mkdir(parents=True, exist_ok=True)  # Slurm cannot create it: a missing one kills the job without a log
    staging = private_dir(log_dir, ".trainstack-submit-")  # becomes the job folder once Slurm named the job
    try:
        snap = take(Path(spec.chdir or "."), staging / JobFiles.CODE, exclude=[log_dir], root=root) \
            if root is not None else None
        ship_driver(staging / JobFiles.DRIVER)
        script = write_script(staging / JobFiles.SCRIPT, text, mode=0o700)  # --env values may be secrets
        deny_others_write(staging)  # the job runs this code and driver as its user: nobody else may change them
        job = _sbatch_held(exe, spec, script, staging, log_dir, tasks, skipped, root if snap else None)
    except SnapshotError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise SubmitError(str(exc)) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:  # a refused submission leaves nothing behind, not even the log folder it made
            with contextlib.suppress(OSError):
                log_dir.rmdir()
        raise
    job.snapshot = snap
    assert job.job_dir is not None  # set by _sbatch_held
    try:
        atomic_write(job.job_dir / JobFiles.METADATA, json.dumps(_metadata(spec, job, argv), indent=2, default=str),
                     mode=0o600)
        _remember(job, spec)
    except BaseException:
        subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)
        raise
    if not hold:
        released = subprocess.run(["scontrol", "release", job.job_id], capture_output=True, text=True, timeout=60)
        if released.returncode != 0:  # a held job that can never start must not wait in the queue forever
            subprocess.run(["scancel", job.job_id], capture_output=True, timeout=60)
            raise SubmitError(f"job {job.job_id} was submitted held and could not be released: "
                              f"{released.stderr.strip()}; it was cancelled (it could not start as asked). HINT: "
                              f"check --nodes, --spare-nodes, --partition and --time against the partition (sinfo).")
    if wait:
        job.exit_code = wait_for(job, echo=echo, timeout=timeout)
    return job


def _sbatch_held(exe: str, spec: LaunchSpec, script: Path, staging: Path, log_dir: Path, tasks: list[int],
                 skipped: list[int], root: Path | None) -> SubmittedJob:
    """``sbatch --hold`` the staged script, then move the staging folder to the job folder Slurm's id names
    (``root``: the repository of the code snapshot in the staging folder, if one was taken)."""
    env = dict(os.environ)
    env.pop(envvars.SNAPSHOT, None)
    if root is not None:  # the job runs from <job folder>/code/<this folder relative to the repository>
        env[envvars.SNAPSHOT] = os.path.relpath(Path(spec.chdir or ".").resolve(), root)
    # Slurm's own check of the request first: a held submission skips it, so a job no node can hold (--mem beyond
    # every node, a partition that does not exist) would otherwise pend forever
    tested = subprocess.run([exe, "--test-only", str(script)], capture_output=True, text=True, timeout=120, env=env)
    if tested.returncode != 0:
        raise _refused(spec, tested.stderr.strip() or tested.stdout.strip(), "Slurm refuses this job")
    args = [exe, "--parsable", "--hold"]
    token = os.environ.get(envvars.SUBMISSION)
    if token:  # a laptop's submission over ssh: findable by its token should the connection drop now
        args.append(f"--comment={SUBMISSION_MARK}{token}")
    if spec.tasks:
        args.append(f"--array={number_ranges(tasks, ',')}" + (f"%{spec.max_parallel}" if spec.max_parallel else ""))
    proc = subprocess.run([*args, str(script)], capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode != 0:
        raise _refused(spec, proc.stderr.strip() or proc.stdout.strip(), "sbatch rejected the script")
    job_id = proc.stdout.strip().split(";")[0]
    paths = JobPaths(log_dir, spec.job_name, job_id, tasks[0] if spec.tasks else None)
    job_dir = paths.job_folder
    try:
        os.replace(staging, job_dir)
        mask = os.umask(0)
        os.umask(mask)
        # readable as a plain mkdir would have made it (teams read each other's logs; the staging folder was
        # private), never writable by group or others: the driver and the ranks act on what they read back in it
        job_dir.chmod(0o755 & ~mask)
    except OSError as exc:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        raise SubmitError(f"job {job_id} was cancelled: its folder {job_dir} could not be created ({exc.strerror})"
                          f".") from None
    return SubmittedJob(job_id, job_dir / JobFiles.SCRIPT, paths.log, job_dir, tasks=tasks if spec.tasks else [],
                        skipped=skipped)


def _refused(spec: LaunchSpec, answer: str, what: str) -> SubmitError:
    """sbatch's refusal, said with what to do about it."""
    said = answer.splitlines()[-1] if answer else "no answer"
    hint = " HINT: this cluster (or partition) has no GPUs: add --cpu to train on CPU processes (gloo)." \
        if "gres" in answer.lower() and not spec.cpu else \
        " HINT: `sinfo -N -o '%N %c %m %G %P'` shows what the nodes have (CPUs, memory in MB, GPUs, partitions)."
    return SubmitError(f"{what}: {said}.{hint}")


def _program_in_snapshot(spec: LaunchSpec, root: Path) -> LaunchSpec:
    """An absolute path to the program inside the repository would run the live file, not the snapshot: make it
    relative to the job's folder, which the job script swaps for its copy."""
    if spec.launcher == "custom" or not spec.program:
        return spec
    words = list(spec.program)
    at = 1 if words[0] in ("bash", "sh", "zsh") and len(words) > 1 else 0
    path = Path(words[at])
    if words[at].startswith("-") or not path.is_absolute() or not path.resolve().is_relative_to(root.resolve()):
        return spec
    words[at] = os.path.relpath(path.resolve(), Path(spec.chdir or ".").resolve())
    return dataclasses.replace(spec, program=words)


def _metadata(spec: LaunchSpec, job: SubmittedJob, argv: list[str] | None) -> dict[str, Any]:
    import getpass
    import platform
    import socket
    from importlib import metadata

    from .._common.version import __version__

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    snap = job.snapshot
    commit, dirty = (snap.commit, snap.dirty) if snap else _git_summary(Path(spec.chdir or "."))
    return {"job_id": job.job_id, "job_name": spec.job_name, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "user": getpass.getuser(), "host": socket.gethostname(), "argv": argv or [], "cwd": str(Path.cwd()),
            "spec": asdict(spec), "git": {"commit": commit, "dirty": dirty,
                                          "changed": snap.changed if snap else None},
            "snapshot": None if snap is None else {"files": snap.files, "bytes": snap.bytes,
                                                   "seconds": round(snap.seconds, 3),
                                                   "untracked": snap.untracked, "skipped": snap.skipped,
                                                   "linked": snap.linked},
            "versions": {"trainstack": __version__, "python": platform.python_version(), "torch": version("torch"),
                         "slurm": _slurm_version()},
            "tasks": [{"index": i, **spec.tasks[i]} for i in job.tasks], "skipped_tasks": job.skipped}


def _git_summary(cwd: Path) -> tuple[str | None, bool | None]:
    root = git_root(cwd)
    if root is None:
        return None, None
    commit, changed, untracked = git_state(root)
    return commit, bool(changed or untracked)


def _slurm_version() -> str | None:
    proc = subprocess.run(["sbatch", "--version"], capture_output=True, text=True, timeout=30)
    return proc.stdout.strip() or None


def _remember(job: SubmittedJob, spec: LaunchSpec) -> None:
    index.remember({"job_id": job.job_id, "name": spec.job_name, "job_dir": str(job.job_dir),
                    "log_dir": str(Path(spec.log_dir).resolve()), "log": str(job.log_path), "tasks": job.tasks,
                    "launcher": spec.launcher, "submission": os.environ.get(envvars.SUBMISSION)})


#: How a job's Slurm comment carries the laptop's submission token.
SUBMISSION_MARK = "trainstack-submission:"


def find_submission(token: str) -> str | None:
    """The job a submission token names: this user's index, else a queued or running job's comment."""
    for record in reversed(index.records()):
        if record.get("submission") == token:
            return str(record["job_id"])
    if shutil.which("squeue") is None:
        return None
    out = subprocess.run(["squeue", "-h", "-r", "--me", "-o", "%F|%k"], capture_output=True, text=True, timeout=30)
    for line in out.stdout.splitlines():
        job, _, comment = line.partition("|")
        if comment.strip() == f"{SUBMISSION_MARK}{token}":
            return job.strip()
    return None


def submit(spec: LaunchSpec, wait: bool = False, **kwargs: Any) -> str:
    """Python API: submit ``spec`` and return the Slurm job id."""
    return submit_spec(spec, wait=wait, **kwargs).job_id


def wait_for(job: SubmittedJob, echo: Callable[[str], None] | None = None, timeout: float | None = None,
             poll: float = 0.5) -> int:
    """Follow the job's log until it (every array task) ends; return its exit code (non-zero for any failure)."""
    try:
        job.exit_code, job.state = status.wait_for(job.job_id, job.log_path, echo, timeout, poll)
    except JobError as exc:
        raise SubmitError(str(exc)) from None
    return job.exit_code


@dataclass
class FunctionJob(SubmittedJob):
    """A submitted Python call; ``result`` waits for the job and returns rank 0's return value."""

    result_path: Path | None = None

    def result(self, timeout: float | None = None) -> object:
        if self.exit_code is None:
            self.exit_code = wait_for(self, timeout=timeout)
        if self.exit_code != 0 or self.result_path is None or not self.result_path.exists():
            log = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else "(no log)"
            raise SubmitError(f"job {self.job_id} failed with exit code {self.exit_code}; log tail:\n{log}")
        try:
            return load_private_pickle(self.result_path)
        except UntrustedFileError as exc:
            raise SubmitError(str(exc)) from None


def submit_function(fn: Callable, args: tuple = (), kwargs: dict | None = None, **spec: object) -> FunctionJob:
    """Send ``fn(*args, **kwargs)`` to Slurm (like nntool's ``slurm_fn``); ``spec`` are LaunchSpec fields.

    The call is pickled into a new private folder ``<log_dir>/<job_name>-XXXX/`` (0700, files 0600: the arguments
    may hold secrets, and a pickle someone else could replace is code execution), which also holds the script, the
    log and the result. ``fn`` must be importable by the job (a module-level function of an installed package or
    of a file on the job's PYTHONPATH).
    """
    import pickle

    spec.setdefault("job_name", getattr(fn, "__name__", "function"))
    try:
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise SubmitError(f"cannot pickle {fn!r} for the job: {exc}. HINT: use a module-level function.") from None
    log_dir = Path(str(spec.pop("log_dir", "logs"))).expanduser().absolute()
    folder = private_dir(log_dir, prefix=f"{safe_name(str(spec['job_name']))}-")
    call = atomic_write(folder / "call.pkl", payload, mode=0o600)
    python = str(spec.pop("python", "python3"))
    launch = LaunchSpec(program=["-m", "trainstack._remote", str(call)], python=python, log_dir=str(folder),
                        **spec)  # type: ignore[arg-type]
    job = submit_spec(launch)
    return FunctionJob(job.job_id, job.script, job.log_path, job_dir=job.job_dir, result_path=folder / "result.pkl")
