"""Shared test helpers (a uniquely named module: `import conftest` is ambiguous with nested conftest files)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ci_leaves_out(why: str) -> pytest.MarkDecorator:
    """A permutation CI leaves to ``make test`` / ``make test-slurm``: its 2-core box confirms one path of each
    capability within its 40 minutes; ``why`` names where the same path is confirmed there."""
    return pytest.mark.skipif(os.environ.get("CI") == "true", reason=f"CI confirms one path ({why}); make test runs "
                                                                      f"this one too")


def python_exe() -> str:
    return sys.executable


def torchrun_exe() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else shutil.which("torchrun") or "torchrun"


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real, small file system (tmpfs) at ``path`` for full-disk tests; skipped where it cannot be mounted."""
    path.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3():
    """moto's S3 server on a free port of 127.0.0.1: (its environment for the clients, its process)."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe is None:
        pytest.skip("moto[server] is not installed (pip install 'moto[server]')")
    port = _free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"moto_server did not start on port {port}")
            time.sleep(0.1)
        yield {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
