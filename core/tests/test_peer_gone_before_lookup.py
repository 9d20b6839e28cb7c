"""A loopback TCP client gone before its connection's lookup ran.

The lookup finds a connection's process by the client's socket, so a client that exited
before it ran was not found: its watch named no process and never said exited.  The
process the client's hint (its HELLO pid) named is now pinned by a pidfd when the
connection is first seen; a lookup that finds the client's socket held by no process
(closed by every holder, or reset) takes that process as the connection's once it has
exited (or is exiting).  One alive, or a socket still held, changes nothing.
Clients are real processes; the scans are the real ones, run once the test lets them.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_tiers.peer_process import (
    PeerSocket,
    peer_socket,
    process_exiting,
    socket_gone,
    watch_peer_socket,
)
from lmcache_tiers.peer_scan import ConnectionPeers, PeerWatch

#: connects to 127.0.0.1:argv[1], says so; "close" as argv[2] then closes the socket
#: and says so; then waits to be killed
CLIENT = """
import socket, sys, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
if sys.argv[2] == "close":
    sock.close()
    print("closed", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock


def connect(
    listener: socket.socket, processes: list[subprocess.Popen[str]], then: str = "stay"
) -> tuple[subprocess.Popen[str], socket.socket]:
    port = str(listener.getsockname()[1])
    process = subprocess.Popen([sys.executable, "-c", CLIENT, port, then], stdout=subprocess.PIPE, text=True)
    processes.append(process)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "connected"
    accepted, _ = listener.accept()
    if then == "close":
        assert process.stdout.readline().strip() == "closed"
    return process, accepted


class HeldScans:
    """The real scan, run only once :attr:`may_scan` is set."""

    def __init__(self) -> None:
        self.may_scan = threading.Event()

    def __call__(self, peer: PeerSocket) -> Any:
        assert self.may_scan.wait(60)
        return watch_peer_socket(peer)


@pytest.fixture
def peers() -> Iterator[tuple[ConnectionPeers, HeldScans]]:
    scans = HeldScans()
    connections = ConnectionPeers(scans, thread_name="tiers-test-peer-scan")
    yield connections, scans
    scans.may_scan.set()
    connections.close()


def settled(watch: PeerWatch) -> PeerWatch:
    assert watch.armed.wait(30), "the lookup did not end"
    return watch


def test_a_client_socket_closed_or_reset_is_told_gone_and_an_open_one_not(listener: socket.socket) -> None:
    for reset in (False, True):
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        with accepted:
            peer = peer_socket(accepted.fileno())
            assert peer is not None
            assert not socket_gone(peer)
            if reset:  # the kernel forgets the socket at once
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            assert socket_gone(peer), "reset" if reset else "closed"


def test_a_client_socket_held_by_another_process_is_not_told_gone(
    listener: socket.socket, processes: list[subprocess.Popen[str]]
) -> None:
    _, accepted = connect(listener, processes)
    with accepted:
        peer = peer_socket(accepted.fileno())
        assert peer is not None
        assert not socket_gone(peer)


def test_a_live_process_is_not_exiting() -> None:
    assert not process_exiting(os.getpid())
    assert not process_exiting(2**22 + 1)  # past any pid: no such process


@pytest.mark.parametrize("unread", [False, True], ids=["closed", "reset"])
def test_a_client_killed_before_its_lookup_is_watched_as_its_hinted_process(
    listener: socket.socket, processes: list[subprocess.Popen[str]], peers: Any, unread: bool
) -> None:
    connections, scans = peers
    client, accepted = connect(listener, processes)
    with accepted:
        watch = connections.watch(accepted.fileno(), hint=client.pid)
        assert watch is not None and not watch.armed.is_set()
        if unread:  # what it never read makes its exit reset the connection
            accepted.sendall(b"unread")
        client.kill()
        client.wait()  # reaped: its pid names nothing now
        scans.may_scan.set()
        settled(watch)
        assert watch.process is not None and watch.process.pids == (client.pid,)
        assert watch.exited()


def test_a_live_client_that_closed_its_socket_is_not_taken_as_exited(
    listener: socket.socket, processes: list[subprocess.Popen[str]], peers: Any
) -> None:
    connections, scans = peers
    client, accepted = connect(listener, processes, then="close")
    with accepted:
        watch = connections.watch(accepted.fileno(), hint=client.pid)
        assert watch is not None
        scans.may_scan.set()
        settled(watch)
        assert watch.process is None and not watch.exited()
        assert watch.pin is None  # given back once the lookup ended


def test_a_hint_naming_another_live_process_is_not_taken(
    listener: socket.socket, processes: list[subprocess.Popen[str]], peers: Any
) -> None:
    connections, scans = peers
    client, accepted = connect(listener, processes)
    other, other_accepted = connect(listener, processes)
    with accepted, other_accepted:
        watch = connections.watch(accepted.fileno(), hint=other.pid)
        assert watch is not None
        client.kill()
        client.wait()
        scans.may_scan.set()
        settled(watch)
        assert watch.process is None and not watch.exited()
