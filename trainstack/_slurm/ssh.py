"""The cluster from a laptop: trainstack commands on a login node over the user's own OpenSSH.

One multiplexed connection per host (``ControlMaster=auto`` with a private control socket in a 0700 folder,
``ControlPersist``), so a session of commands asks for a password or MFA at most once; ``BatchMode=yes`` so nothing
ever waits at a prompt in a script; ``reuse_only`` refuses to open a connection (MFA clusters: the user opens one
with ``ssh -fN``). Every word of a remote command is quoted (``shlex.join``): the remote shell sees data, never code.
Code travels with rsync over the same connection, incrementally. Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .._common import envvars as envvars
from ..errors import TrainstackError

__all__ = ["Remote", "RemoteError", "control_dir"]

_CONNECT_TIMEOUT_S = 15
_PERSIST_S = 600
_SENT = re.compile(r"Total bytes sent: ([\d,]+)")


class RemoteError(TrainstackError):
    """The host could not be reached, refused the key, or lacks what trainstack needs there."""


#: A Unix socket path holds at most ~104 bytes; ssh's %C (a 40-character hash) and a suffix ssh adds while it
#: creates the socket come after the folder.
_SOCKET_ROOM = 104 - 41 - 18


def control_dir() -> Path:
    """The private folder of the control sockets (0700, this user's): ``$XDG_RUNTIME_DIR/trainstack-ssh``,
    ``~/.ssh/trainstack-ssh``, else -- when those paths are too long for a socket -- ``/tmp/trainstack-ssh-<uid>``.
    A folder another user owns (or a link to one) is refused, naming it."""
    candidates = [Path(os.environ["XDG_RUNTIME_DIR"]) / "trainstack-ssh"] if os.environ.get("XDG_RUNTIME_DIR") else []
    candidates += [Path.home() / ".ssh" / "trainstack-ssh", Path(f"/tmp/trainstack-ssh-{os.getuid()}")]
    folder = next((c for c in candidates if len(str(c)) <= _SOCKET_ROOM), candidates[-1])
    try:
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        if os.path.islink(folder) or st.st_uid != os.getuid():
            raise RemoteError(f"the ssh control folder {folder} is a link or belongs to uid {st.st_uid}, not to you: "
                              f"another user could hijack the connection. HINT: remove it, or set XDG_RUNTIME_DIR to "
                              f"a folder of yours.")
        os.chmod(folder, 0o700)
    except OSError as exc:
        raise RemoteError(f"cannot use the ssh control folder {folder}: {exc.strerror or exc}. HINT: set "
                          f"XDG_RUNTIME_DIR to a short folder of yours.") from None
    return folder


class Remote:
    """One host, as the user types it after ``ssh`` (an alias of ``~/.ssh/config``, ``user@host``)."""

    def __init__(self, dest: str, trainstack: str = "trainstack", reuse_only: bool = False,
                 ssh_options: Sequence[str] = ()) -> None:
        if not dest or dest.startswith("-"):
            raise RemoteError(f"--host {dest!r} is not a host: give what you type after ssh (an alias, user@host)")
        self.dest, self.trainstack, self.reuse_only = dest, trainstack, reuse_only
        config = os.environ.get(envvars.SSH_CONFIG)  # an ssh config of its own (else ~/.ssh/config)
        self.options = [*(["-F", config] if config else []), "-o", "BatchMode=yes",
                        "-o", f"ConnectTimeout={_CONNECT_TIMEOUT_S}",
                        "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=3",
                        "-o", f"ControlPath={control_dir()}/%C", "-o", f"ControlPersist={_PERSIST_S}",
                        "-o", "ControlMaster=no" if reuse_only else "ControlMaster=auto", *ssh_options]

    # ------------------------------------------------------------------ connection
    def ssh(self, command: Sequence[str]) -> list[str]:
        """The argv of ``ssh`` running ``command`` (every word quoted) on the host."""
        return ["ssh", *self.options, self.dest, "--", shlex.join(list(command))]

    def check_connection(self) -> None:
        """With ``reuse_only``: an open master connection, or an error saying how to open one."""
        if not self.reuse_only:
            return
        probe = subprocess.run(["ssh", *self.options, "-O", "check", self.dest], capture_output=True, text=True,
                               timeout=30)
        if probe.returncode != 0:
            path = f"{control_dir()}/%C"
            raise RemoteError(f"no open connection to {self.dest} (reuse-only mode never opens one, for hosts that "
                              f"ask for MFA). HINT: open it once, answering the prompts: ssh -fN -o "
                              f"ControlMaster=yes -o ControlPath={path} -o ControlPersist={_PERSIST_S} {self.dest}")

    def run(self, command: Sequence[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``command`` on the host, capturing its output; an ssh failure (exit 255) is a RemoteError."""
        self.check_connection()
        try:
            out = subprocess.run(self.ssh(command), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RemoteError(f"{self.dest} did not answer within {timeout:g} s "
                              f"({shlex.join(list(command))})") from None
        if out.returncode == 255:
            raise RemoteError(self._explain(out.stderr))
        if check and out.returncode != 0:
            raise RemoteError(f"on {self.dest}: `{shlex.join(list(command))}` failed (exit {out.returncode}): "
                              f"{(out.stderr or out.stdout).strip()[-1500:]}")
        return out

    def stream(self, command: Sequence[str]) -> int:
        """Run ``command`` with its output going straight to ours; its exit status (255: the connection)."""
        self.check_connection()
        return subprocess.run(self.ssh(command)).returncode

    def _explain(self, stderr: str) -> str:
        text = stderr.strip()
        if "Permission denied" in text:
            hint = "the host refused the key: ssh-copy-id, or an IdentityFile for it in ~/.ssh/config"
        elif "Could not resolve" in text or "Name or service not known" in text:
            hint = "the host name is unknown: an alias in ~/.ssh/config, or user@host"
        elif "Connection refused" in text or "timed out" in text or "No route" in text:
            hint = "the host is unreachable from here (VPN? a ProxyJump in ~/.ssh/config?)"
        elif "Host key verification failed" in text:
            hint = "its host key is not in ~/.ssh/known_hosts: connect once with plain ssh to accept it"
        else:
            hint = "try `ssh " + self.dest + "` by hand"
        return f"cannot reach {self.dest} over ssh: {text[-500:] or 'exit 255'}. HINT: {hint}."

    # ------------------------------------------------------------------ trainstack there
    def trainstack_version(self) -> str:
        """The host's trainstack version; a clear error when it has none (on a non-interactive ssh's PATH)."""
        out = self.run([self.trainstack, "--version"], check=False)
        if out.returncode != 0:
            raise RemoteError(f"trainstack is not installed on {self.dest} (`{self.trainstack} --version` failed: "
                              f"{(out.stderr or out.stdout).strip()[-300:]}). HINT: pip install trainstack there, "
                              f"or point {envvars.REMOTE_TRAINSTACK} at its executable (a venv's bin/trainstack).")
        return out.stdout.strip().split()[-1] if out.stdout.strip() else "?"

    def trainstack_command(self, args: Sequence[str]) -> list[str]:
        return [self.trainstack, *args]

    # ------------------------------------------------------------------ files
    def rsync(self, sources: list[str], target: str, files_from: Path | None = None, pull: bool = False,
              extra: Sequence[str] = ()) -> int:
        """Copy with rsync over the same connection; the bytes sent (incremental: unchanged files cost nothing)."""
        self.check_connection()
        ssh = shlex.join(["ssh", *self.options])
        argv = ["rsync", "-a", "--stats", "-e", ssh, "--protect-args", *extra]
        if files_from is not None:
            argv += ["--files-from", str(files_from)]
        if pull:
            argv += [f"{self.dest}:{sources[0]}", target]
        else:
            argv += [*sources, f"{self.dest}:{target}"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RemoteError(f"rsync to {self.dest} failed (exit {out.returncode}): {out.stderr.strip()[-800:]}")
        found = _SENT.search(out.stdout)
        return int(found.group(1).replace(",", "")) if found else 0

    def follow(self, args: Sequence[str], tries: int = 5) -> int:
        """``trainstack logs --follow`` there, surviving dropped connections: reconnect and continue from the byte
        offset already printed (no line twice)."""
        offset, failures = 0, 0
        while True:
            self.check_connection()
            cmd = self.ssh(self.trainstack_command([*args, "--from-byte", str(offset)]))
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
            out = proc.stdout
            assert out is not None
            while chunk := out.read1(65536):  # type: ignore[attr-defined]  # a BufferedReader
                offset += len(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
            code = proc.wait()
            if code != 255:
                return code
            failures += 1
            if failures > tries:
                raise RemoteError(f"lost the connection to {self.dest} {failures} times while following the log")
            print(f"trainstack: connection to {self.dest} lost; reconnecting (byte {offset})", file=sys.stderr)
            time.sleep(1.0)
