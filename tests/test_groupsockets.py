"""``_runtime/groupsockets.py`` on real sockets: the connections a block opens are noted (not a listener, not one on
the store's port, not one opened before), and shutting them down makes the peer's blocked read end at once --
what a rank of the other HSDP replica group needs when a survivor gives up on the failed group."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from trainstack._runtime import groupsockets

pytestmark = pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="Linux /proc")


def _server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    return srv, srv.getsockname()[1]


def test_the_connections_a_group_opened_are_shut_down_and_the_blocked_peer_reads_the_end():
    peer, port = _server()  # the other rank's end
    store, store_port = _server()
    before = socket.create_connection(("127.0.0.1", port))  # opened before the group: not its
    accepted_before, _ = peer.accept()
    try:
        with groupsockets.opening(store_port):
            mine = socket.create_connection(("127.0.0.1", port))
            to_store = socket.create_connection(("127.0.0.1", store_port))
            listener, _ = _server()  # a listener of the group (gloo's): never shut down
        theirs, _ = peer.accept()
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(theirs.recv(10)), daemon=True)
        reader.start()  # the peer blocked in a read from this rank, as in a collective
        time.sleep(0.1)
        started = time.monotonic()
        assert groupsockets.shut() == 1
        reader.join(5)
        assert got == [b""] and time.monotonic() - started < 2  # the end of the stream, at once
        assert mine.fileno() >= 0  # the descriptor is left to its owner
        before.sendall(b"x")  # an earlier connection and the store's still work
        assert accepted_before.recv(1) == b"x"
        to_store.sendall(b"y")
        assert store.accept()[0].recv(1) == b"y"
        assert groupsockets.shut() == 0  # nothing noted twice
        for s in (mine, to_store, listener, theirs):
            s.close()
    finally:
        for s in (peer, store, before, accepted_before):
            s.close()


def test_a_group_that_ended_cleanly_has_nothing_to_shut_down():
    peer, port = _server()
    with groupsockets.opening(0):
        mine = socket.create_connection(("127.0.0.1", port))
    groupsockets.forget()
    assert groupsockets.shut() == 0
    mine.sendall(b"z")
    theirs, _ = peer.accept()
    assert theirs.recv(1) == b"z"
    for s in (mine, theirs, peer):
        s.close()
