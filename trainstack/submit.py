"""Write scripts and hand them to Slurm (`sbatch`); the I/O half of the generator."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._files import UntrustedFileError, atomic_write, load_private_pickle, private_dir
from .errors import TrainstackError
from .render import LaunchSpec, render, safe_name

__all__ = ["SubmitError", "SubmittedJob", "FunctionJob", "write_script", "submit", "submit_spec",
           "submit_function"]


class SubmitError(TrainstackError, RuntimeError):
    """sbatch is missing or refused the script."""


@dataclass
class SubmittedJob:
    job_id: str
    script: Path
    log_path: Path
    exit_code: int | None = None
    state: str | None = None


def write_script(path: Path, text: str) -> Path:
    """Write atomically (temp + rename) and make it executable; a partial script never appears."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, text, mode=0o755)


def _sbatch() -> str:
    exe = shutil.which("sbatch")
    if exe is None:
        raise SubmitError("sbatch not found on PATH. HINT: run on a Slurm login node, or use `trainstack generate` "
                          "to write the script and submit it there.")
    return exe


def submit_spec(spec: LaunchSpec, wait: bool = False, templates_dir: str | None = None,
                command_line: str | None = None, echo: Callable[[str], None] | None = None,
                timeout: float | None = None) -> SubmittedJob:
    """Render ``spec``, create the log directory (a missing one kills the job without any log), sbatch it."""
    log_dir = Path(spec.log_dir).expanduser().absolute()
    log_dir.mkdir(parents=True, exist_ok=True)
    script = write_script(log_dir / f"{_safe(spec.job_name)}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sbatch",
                          render(spec, templates_dir, command_line))
    proc = subprocess.run([_sbatch(), "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SubmitError(f"sbatch rejected {script}: {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    job = SubmittedJob(job_id, script, log_dir / f"{spec.job_name}-{job_id}.out")
    if wait:
        job.exit_code = wait_for(job, echo=echo, timeout=timeout)
    return job


def submit(spec: LaunchSpec, wait: bool = False, **kwargs: object) -> str:
    """Python API: submit ``spec`` and return the Slurm job id."""
    return submit_spec(spec, wait=wait, **kwargs).job_id  # type: ignore[arg-type]


def _state(job_id: str) -> tuple[str, int | None]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    state = re.search(r"JobState=(\S+)", out.stdout)
    code = re.search(r"ExitCode=(\d+):(\d+)", out.stdout)
    exit_code = None
    if code:
        exit_code = int(code.group(1)) or (128 + int(code.group(2)) if int(code.group(2)) else 0)
    return (state.group(1) if state else "UNKNOWN"), exit_code


_DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE", "UNKNOWN"}


def wait_for(job: SubmittedJob, echo: Callable[[str], None] | None = None, timeout: float | None = None,
             poll: float = 0.5) -> int:
    """Follow the job's log until it ends; return its exit code (non-zero for any failure state)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    offset = 0
    while True:
        state, code = _state(job.job_id)
        if echo and job.log_path.exists():
            with open(job.log_path, encoding="utf-8", errors="replace") as fh:
                fh.seek(offset)
                chunk = fh.read()
                offset = fh.tell()
            if chunk:
                echo(chunk)
        if state in _DONE:
            time.sleep(1.0)  # a requeue passes through terminal-looking states: believe only a stable one
            again, code = _state(job.job_id)
            if again in _DONE:
                job.state = again
                return 0 if again == "COMPLETED" else (code or 1)
        if deadline is not None and time.monotonic() > deadline:
            subprocess.run(["scancel", job.job_id], timeout=30)
            raise SubmitError(f"job {job.job_id} did not finish within {timeout:.0f}s; cancelled it.")
        time.sleep(poll)


_safe = safe_name


@dataclass
class FunctionJob(SubmittedJob):
    """A submitted Python call; :meth:`result` waits for the job and returns rank 0's return value."""

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
    folder = private_dir(log_dir, prefix=f"{_safe(str(spec['job_name']))}-")
    call = atomic_write(folder / "call.pkl", payload, mode=0o600)
    python = str(spec.pop("python", "python3"))
    launch = LaunchSpec(program=["-m", "trainstack._remote", str(call)], python=python, log_dir=str(folder),
                        **spec)  # type: ignore[arg-type]
    job = submit_spec(launch)
    return FunctionJob(job.job_id, job.script, job.log_path, result_path=folder / "result.pkl")
