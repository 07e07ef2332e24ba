"""A real OpenSSH server in front of a local Slurm, for the `--host` tests (test_remote.py) and the runs across
clusters (test_across_clusters.py): a second Unix account with its own trainstack install, its own sshd (-f config
on a free port of 127.0.0.1, a throw-away host key, started and stopped by pid), and the environment each login gets
(SetEnv: the cluster's SLURM_CONF, a store's endpoint)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from helpers import ROOT

VENV = Path("/opt/tsremote-venv")  # the remote accounts' own install: trainstack and a CPU torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remote_install() -> Path:
    """The accounts' trainstack: a venv of the system python with trainstack's dependencies (and s3fs for a
    checkpoint store), this checkout on its path; its ``trainstack-remote`` wrapper."""
    import torch

    if not (VENV / "bin" / "python").exists():
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(VENV)], check=True, timeout=120)
    if subprocess.run([str(VENV / "bin" / "python"), "-c", "import torch, click, jinja2, rich, hostlist"],
                      capture_output=True).returncode != 0:  # torch pinned as here (the CPU wheel), first
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"torch=={torch.__version__.split('+')[0]}",
                        "numpy"], check=True, timeout=600)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "click>=8.1", "jinja2>=3.1", "rich>=13",
                        "python-hostlist>=1.23"], check=True, timeout=300)
    if subprocess.run([str(VENV / "bin" / "python"), "-c", "import cloudpickle, s3fs"],
                      capture_output=True).returncode != 0:  # a Trainer's job with a checkpoint store
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "cloudpickle>=2.2", "s3fs>=2024.2"],
                       check=True, timeout=300)
    src = VENV / "src"  # this checkout's package, where the account can read it (a CI checkout may not be)
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ROOT / "trainstack", src / "trainstack", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "templates", src / "templates")
    wrapper = VENV / "bin" / "trainstack-remote"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={src} exec {VENV}/bin/python -m trainstack \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def account(user: str) -> Path:
    """A login account (no password, not locked: sshd refuses a locked one); its home."""
    if subprocess.run(["id", user], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", user], check=True)
    subprocess.run(["usermod", "-p", "*", user], check=True)
    return Path(pwd.getpwnam(user).pw_dir)


@contextlib.contextmanager
def sshd(tmp: Path, user: str, env: dict[str, str], authorized: Path) -> Iterator[int]:
    """An sshd for ``user`` only, on a free port; every login gets ``env`` (SetEnv). Stopped (and the account's
    processes killed) at the end."""
    name = f"sshd-{user}"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / f"{name}_host_key")], check=True)
    port = free_port()
    conf = tmp / f"{name}_config"
    setenv = " ".join(f"{k}={v}" for k, v in env.items())
    conf.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp}/{name}_host_key\n"
                    f"PidFile {tmp}/{name}.pid\nAuthorizedKeysFile {authorized}\nStrictModes no\n"
                    f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin no\n"
                    f"AllowUsers {user}\nSetEnv {setenv}\nMaxSessions 50\nSubsystem sftp internal-sftp\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    subprocess.run(["/usr/sbin/sshd", "-f", str(conf), "-E", str(tmp / f"{name}.log")], check=True)
    try:
        yield port
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((tmp / f"{name}.pid").read_text()), signal.SIGTERM)
        subprocess.run(["pkill", "-u", user], check=False)


def keys(prefix: str = "trainstack-sshd-") -> Path:
    """A folder sshd can read as the account (pytest's own 0700 folders are out of its reach) with a client key."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    tmp.chmod(0o755)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "id")], check=True)
    (tmp / "authorized_keys").write_text((tmp / "id.pub").read_text())
    (tmp / "authorized_keys").chmod(0o644)
    return tmp
