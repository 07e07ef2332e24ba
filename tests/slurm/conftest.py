"""Access to the local 3-node Slurm (node1-3) (`make slurm-up`). In CI (CI=true) a missing cluster is a failure."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

DEFAULT_CONF = "/tmp/trainstack-slurm/slurm.conf"


def _cluster_ready(env: dict[str, str]) -> str | None:
    if not shutil.which("sbatch"):
        return "sbatch not found (apt-get install slurm-wlm munge)"
    if not Path(env.get("SLURM_CONF", "")).exists():
        return f"no slurm.conf at {env.get('SLURM_CONF')!r}"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if out.returncode != 0 or "idle" not in out.stdout and "mix" not in out.stdout and "alloc" not in out.stdout:
        return f"cluster not up: {out.stdout.strip()} {out.stderr.strip()}"
    return None


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """Environment for Slurm client commands; skips (or fails in CI) when no cluster is running."""
    env = dict(os.environ)
    env.setdefault("SLURM_CONF", DEFAULT_CONF)
    problem = _cluster_ready(env)
    if problem:
        msg = f"local Slurm unavailable: {problem}. Start it with `make slurm-up` (root), then run `make test-slurm`."
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return env


@pytest.fixture
def shared_tmp(tmp_path):
    """A folder both fake nodes can read and write (they share this host's file system)."""
    tmp_path.chmod(0o777)
    return tmp_path


@pytest.fixture(autouse=True)
def no_jobs_left_behind(request):
    """Cancel every job a test submitted, whatever happened."""
    yield
    env = request.node.funcargs.get("slurm_env")
    if env:
        subprocess.run(["scancel", "--quiet", "--name", "trainstack-test"], env=env, timeout=30)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed cluster test carries what a reader needs to see why: the queue, the nodes and the tails of the job
    logs it wrote (a CI failure otherwise says only "timed out")."""
    outcome = yield
    report = outcome.get_result()
    env = item.funcargs.get("slurm_env") if hasattr(item, "funcargs") else None
    if not env or report.passed or call.when != "call":
        return
    text = []
    for cmd in (["squeue", "-o", "%i %j %T %r %N"], ["sinfo", "-N", "-o", "%N %t %E"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            text.append("$ " + " ".join(cmd) + "\n" + subprocess.run(cmd, env=env, capture_output=True, text=True,
                                                                     timeout=20).stdout)
    folders = {v for v in item.funcargs.values() if isinstance(v, Path)}
    logs = sorted((p for f in folders for p in f.glob("**/logs/*.out") if p.stat().st_mtime >= call.start),
                  key=lambda p: p.stat().st_mtime)
    controller = Path(env.get("SLURM_CONF", "/nonexistent")).parent / "log" / "slurmctld.log"
    for log in logs[-3:]:
        text += [_tail(log, 80), *(_tail(log.with_suffix("") / name, 25) for name in ("sentinel.out", "events.jsonl"))]
        job_id = log.stem.rsplit("-", 1)[-1]
        with contextlib.suppress(OSError):
            said = [line for line in controller.read_text(errors="replace").splitlines() if f"JobId={job_id} " in
                    line or line.endswith(f"JobId={job_id}") or "not responding" in line]
            text.append(f"--- slurmctld on job {job_id} (last 30 lines)\n" + "\n".join(said[-30:]))
        for daemon in sorted(controller.parent.glob("slurmd-*.log")):  # each step's fate on each node
            with contextlib.suppress(OSError):
                said = [line for line in daemon.read_text(errors="replace").splitlines() if f"{job_id}." in line]
                text.append(f"--- {daemon.name} on job {job_id} (last 15 lines)\n" + "\n".join(said[-15:]))
    report.sections.append(("slurm state and job logs", "\n".join(text)))


def _tail(path: Path, n: int) -> str:
    """The last ``n`` lines of ``path`` under a heading (or that it is missing)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"--- {path}: none"
    return f"--- {path} (last {n} of {len(lines)} lines)\n" + "\n".join(lines[-n:])
