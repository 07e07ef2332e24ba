"""Hermetic tests: the environment and the process group are restored after every test."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid

import pytest
from helpers import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))  # development fixtures (spec_matrix, defcheck) live there



def pytest_configure(config):
    """`make test &` and `nohup make test` start pytest with SIGINT ignored, and an ignored signal is inherited by
    every process it starts: the Ctrl-C tests (in this process and in the programs they start) need what a
    terminal gives. A Python handler is reset to the default in an exec'd child."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Variables torch itself sets lazily (e.g. on first DDP construction); not ours to police.
_TORCH_OWN = ("TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_", "KMP_", "CUDA_MODULE_LOADING")


@pytest.fixture(scope="session", autouse=True)
def private_job_index(tmp_path_factory):
    """Jobs the tests submit go to a session-private index, never the user's own ~/.local/state/trainstack (their
    `trainstack status` would list hundreds of test jobs); child processes inherit it."""
    previous = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("xdg-state"))
    yield
    if previous is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = previous


@pytest.fixture(autouse=True)
def restore_environ():
    """Fail loudly if code under test leaks variables into os.environ, then restore it."""
    before = dict(os.environ)
    yield
    leaked = {k: os.environ[k] for k in os.environ.keys() - before.keys() if not k.startswith(_TORCH_OWN)}
    os.environ.clear()
    os.environ.update(before)
    assert not leaked, f"test leaked environment variables: {leaked}"


@pytest.fixture(autouse=True)
def teardown_process_group():
    """A process group a test left is destroyed (torch only where a test imported it: the driver's tests run in a
    venv without torch)."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def run_py(tmp_path):
    """Run a command with a hard timeout; return the CompletedProcess (output merged)."""

    def _run(args, timeout=120, env=None, cwd=None, check=True):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        child = subprocess.Popen(args, cwd=cwd or ROOT, env=full_env, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the whole session: launchers and their workers
            out, _ = child.communicate()
            pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, args))}\n{out[-4000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # nothing of this command may outlive the test
        proc = subprocess.CompletedProcess(args, child.returncode, out, None)
        if check and proc.returncode != 0:
            pytest.fail(f"command failed ({proc.returncode}): {' '.join(map(str, args))}\n{proc.stdout[-4000:]}")
        return proc

    return _run


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on 127.0.0.1 for one test module; its environment for the clients."""
    from helpers import moto_s3

    with moto_s3() as (env, _):
        yield env


@pytest.fixture
def bucket(s3_server, monkeypatch):
    """A fresh bucket; the S3 environment set for this process and what it starts."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an earlier module's client points at its own (stopped) server
    name = f"ts-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
    return name
