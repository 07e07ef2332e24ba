"""The TCP connections this process's process groups opened, so that a rank leaving a failed group can close them.

Gloo closes a group's connections only once nothing holds the group, and a sharded model's mesh -- which holds its
groups -- stays in torch's own DTensor caches: a survivor that gave up on a failed HSDP group would leave a peer of
the other replica group, blocked in a collective with it, waiting for the collective timeout (gloo's ``abort`` and
``shutdown`` close no connection). So the sockets each group's creation opens here are noted (its connections to
its peers: not its listener, whose shutdown gloo's accept loop does not survive, nor the store's, on the store's
port) and shut down when this rank leaves a failed group: the blocked peer fails at once ("Connection closed by
peer") and can wait in place too. Linux (``/proc``); elsewhere nothing is noted and a group closes as before.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = ["opening", "shut", "forget"]

_OPENED: set[int] = set()  # socket inodes the groups of this process opened
_STORE_PORT: list[int] = [0]  # the port of the store the groups rendezvous through (its connections are not theirs)


@contextlib.contextmanager
def opening(store_port: int | None = None, gloo: bool = True) -> Iterator[None]:
    """Note the TCP connections the block opens in this process (a group's creation: ``init_process_group``, a
    mesh's ``new_group``s), leaving out listeners and those on ``store_port`` (the last one given when None). Only
    gloo's (``gloo``): NCCL's own sockets belong to threads whose handling of a shut-down socket is unchecked."""
    if store_port is not None:
        _STORE_PORT[0] = store_port
    if not gloo:
        yield
        return
    before = _sockets()
    try:
        yield
    finally:
        ports = _tcp_ports()
        _OPENED.update(inode for inode in set(_sockets().values()) - set(before.values())
                       if inode in ports and ports[inode][1] and _STORE_PORT[0] not in ports[inode])


def shut() -> int:
    """Shut down (both ways, the descriptors left to their owner) the sockets the groups opened that are still
    open; how many. Only after the group failed: its collectives fail at once on every peer."""
    closed = 0
    for fd, inode in _sockets().items():
        if inode in _OPENED:
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
            except OSError:
                pass
            finally:
                sock.detach()  # the descriptor stays gloo's: closing it here could close a reused number later
    _OPENED.clear()
    return closed


def forget() -> None:
    """The groups ended cleanly: nothing to shut down."""
    _OPENED.clear()


def _sockets() -> dict[int, int]:
    """This process's socket descriptors -> their inodes (empty where ``/proc`` is not there)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            found[int(name)] = st.st_ino
    return found


def _tcp_ports() -> dict[int, tuple[int, int]]:
    """TCP socket inode -> (local port, remote port), from ``/proc/net/tcp`` and ``tcp6``."""
    ports: dict[int, tuple[int, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[9].isdigit():
                ports[int(fields[9])] = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16))
    return ports
