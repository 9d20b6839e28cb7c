"""The pid a client says it has is where a loopback TCP scan looks first, never trusted.

Real client processes connect over loopback TCP; the full scan of every process is counted
through the hook ``peer_socket_pids`` takes, so a test tells which way a holder was found.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from lmcache_tiers import peer_process
from lmcache_tiers.peer_process import (
    PeerProcess,
    PeerSocket,
    peer_socket,
    peer_socket_pids,
    socket_holders,
    watch_peer_socket,
)
from lmcache_tiers.peer_scan import ConnectionPeers

#: connects to port argv[1] on loopback (argv[3] times); with argv[2] == "fork" a child
#: inherits the sockets and both stay ("fork<n>": n children); prints the holders' pids
#: (the creator first), then waits to be killed
CLIENT = """
import os, socket, sys, time
sockets = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(int(sys.argv[3]))]
pids = [os.getpid()]
for _ in range(int(sys.argv[2][4:] or 1) if sys.argv[2].startswith("fork") else 0):
    child = os.fork()
    if child == 0:
        time.sleep(3600)
        os._exit(0)
    pids.append(child)
print(" ".join(map(str, pids)), flush=True)
time.sleep(3600)
"""


class CountingScan:
    """The full scan, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, inode: int) -> tuple[int, ...]:
        self.calls += 1
        return socket_holders(inode)


#: starts a client ("alone" or "fork"): its connection's far end as the server reads it,
#: the client's pids (the creator first) and the server side's descriptor
Connect = Callable[..., tuple[PeerSocket, list[int], int]]


class _Clients:
    """Client processes connected to a loopback listener of this process, killed at the end."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.opened: list[tuple[subprocess.Popen[str], list[socket.socket]]] = []

    def start(self, mode: str, connections: int = 1) -> tuple[list[int], list[socket.socket]]:
        """Run ``CLIENT`` in ``mode``: the pids it prints and the server's side of its
        ``connections``."""
        process = subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(self.listener.getsockname()[1]), mode, str(connections)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        pids = [int(pid) for pid in process.stdout.readline().split()]
        accepted = [self.listener.accept()[0] for _ in range(connections)]
        self.opened.append((process, accepted))
        return pids, accepted

    def close(self) -> None:
        for process, accepted in self.opened:
            for pid in _children(process.pid):
                os.kill(pid, 9)
            process.kill()
            process.wait()
            assert process.stdout is not None
            process.stdout.close()
            for connection in accepted:
                connection.close()
        self.listener.close()


def _far_end(connection: socket.socket) -> PeerSocket:
    peer = peer_socket(connection.fileno())
    assert peer is not None and peer.far
    return peer


@pytest.fixture
def clients() -> Iterator[_Clients]:
    started = _Clients()
    yield started
    started.close()


@pytest.fixture
def connect(clients: _Clients) -> Connect:
    def start(mode: str = "alone") -> tuple[PeerSocket, list[int], int]:
        pids, (accepted,) = clients.start(mode)
        return _far_end(accepted), pids, accepted.fileno()

    return start


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as listed:
        return [int(child) for child in listed.read().split()]


def test_the_hint_finds_the_holder_without_the_full_scan(connect: Connect) -> None:
    peer, pids, _ = connect()
    scan = CountingScan()
    assert peer_socket_pids(dataclasses.replace(peer, hint=pids[0]), scan) == (pids[0],)
    assert scan.calls == 0


def test_a_hint_holding_nothing_falls_back_to_the_full_scan(connect: Connect) -> None:
    peer, pids, _ = connect()
    _, others, _ = connect()  # a live process holding another connection: a wrong hint
    for wrong in (others[0], os.getpid(), 2**22 + 1):
        scan = CountingScan()
        assert peer_socket_pids(dataclasses.replace(peer, hint=wrong), scan) == (pids[0],)
        assert scan.calls == 1


def test_a_forked_child_holding_the_socket_is_found_through_the_hint(connect: Connect) -> None:
    peer, pids, _ = connect("fork")
    scan = CountingScan()
    assert peer_socket_pids(dataclasses.replace(peer, hint=pids[0]), scan) == tuple(sorted(pids))
    assert scan.calls == 0
    assert peer_socket_pids(peer, scan) == tuple(sorted(pids))  # what the full scan finds: the same
    assert scan.calls == 1


def test_a_hint_naming_a_forked_child_while_its_parent_holds_the_socket_is_not_used(connect: Connect) -> None:
    # The HELLO names the child; the parent, outside the child's tree, holds the socket
    # too and may write: the answer is the full scan's, both
    peer, pids, _ = connect("fork")
    scan = CountingScan()
    assert peer_socket_pids(dataclasses.replace(peer, hint=pids[1]), scan) == tuple(sorted(pids))
    assert scan.calls == 1


def test_a_hint_naming_an_ancestor_of_the_holder_finds_it_below(connect: Connect) -> None:
    # The test's own process started the client: the client is its descendant
    peer, pids, _ = connect()
    scan = CountingScan()
    hinted = dataclasses.replace(peer, hint=os.getppid())
    assert peer_socket_pids(hinted, scan) == (pids[0],)
    assert scan.calls == 0


def test_a_tree_larger_than_the_walk_reads_is_left_to_the_full_scan(connect: Connect) -> None:
    # A client forking without end must not keep the scan worker reading its tree: past
    # the bound the walk stops, and the full scan answers
    peer, pids, _ = connect(f"fork{peer_process._HINT_TREE_PROCESSES}")
    scan = CountingScan()
    assert peer_socket_pids(dataclasses.replace(peer, hint=pids[0]), scan) == tuple(sorted(pids))
    assert scan.calls == 1


def test_a_process_of_more_threads_than_the_walk_reads_is_left_to_the_full_scan(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer, pids, _ = connect()
    monkeypatch.setattr(peer_process, "_HINT_TREE_THREADS", 0, raising=False)
    scan = CountingScan()
    assert peer_socket_pids(dataclasses.replace(peer, hint=pids[0]), scan) == (pids[0],)
    assert scan.calls == 1


#: connects to port argv[1] on loopback, then prints the id of a second thread it starts
THREADED_CLIENT = """
import socket, sys, threading, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
threading.Thread(target=lambda: (print(threading.get_native_id(), flush=True), time.sleep(3600))).start()
"""


def test_a_hint_naming_a_thread_of_the_client_never_watches_the_thread_alone() -> None:
    # /proc/<tid> reads as its process, so the thread is found holding the socket; a
    # watch of it would end at the thread's exit while the process writes on: none is
    # made (the fences stay as for a client that cannot be told), or one of the process
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = subprocess.Popen(
            [sys.executable, "-c", THREADED_CLIENT, str(listener.getsockname()[1])],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert client.stdout is not None
            thread = int(client.stdout.readline())
            accepted, _ = listener.accept()
            with accepted:
                peer = peer_socket(accepted.fileno())
                assert peer is not None and thread != client.pid
                watch = watch_peer_socket(dataclasses.replace(peer, hint=thread))
                assert watch is None or watch.pids == (client.pid,)
                if watch is not None:
                    watch.close()
        finally:
            client.kill()
            client.wait()
            assert client.stdout is not None
            client.stdout.close()


def test_a_connection_watched_with_a_hint_is_scanned_with_it(connect: Connect) -> None:
    _, pids, fd = connect()
    seen: list[PeerSocket] = []

    def scan(peer: PeerSocket) -> PeerProcess | None:
        seen.append(peer)
        return watch_peer_socket(peer)

    connections = ConnectionPeers(scan)
    try:
        watch = connections.watch(fd, hint=pids[0])
        assert watch is not None
        assert watch.armed.wait(60)  # by the worker
        assert [peer.hint for peer in seen] == [pids[0]]
        assert watch.process is not None and watch.process.pids == (pids[0],)
    finally:
        connections.close()


@pytest.fixture
def connect_twice(clients: _Clients) -> Callable[[str], tuple[list[PeerSocket], list[int]]]:
    """Starts a client ("alone" or "fork") connected twice: both connections' far ends as
    the server reads them, and the client's pids (the creator first)."""

    def start(mode: str) -> tuple[list[PeerSocket], list[int]]:
        pids, accepted = clients.start(mode, connections=2)
        return [_far_end(connection) for connection in accepted], pids

    return start


def _ancestors(pid: int) -> set[int]:
    """The processes above ``pid``, up to the root."""
    found: set[int] = set()
    while True:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            pid = int(stat.read().rpartition(")")[2].split()[1])
        if pid <= 0:
            return found
        found.add(pid)


def test_the_ancestors_of_a_hinted_process_are_read_once_for_all_its_connections(
    connect_twice: Callable[[str], tuple[list[PeerSocket], list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading an ancestor is reading all its descriptors (init holds hundreds); an ancestor
    # can share with the process only sockets it held before the process was forked, so
    # what they held, read once, answers for every later connection of the process
    peers, pids = connect_twice("alone")
    above = {f"/proc/{pid}/fd" for pid in _ancestors(pids[0]) - {os.getpid()}}
    assert above, "the client has ancestors other than this process"
    reads: list[str] = []
    scandir = os.scandir

    def counted(path: str) -> object:
        if path in above:
            reads.append(path)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", counted)
    first, second = (dataclasses.replace(peer, hint=pids[0]) for peer in peers)
    scan = CountingScan()
    assert peer_socket_pids(first, scan) == (pids[0],)
    assert reads, "the ancestors were read for the first connection"
    reads.clear()
    assert peer_socket_pids(second, scan) == (pids[0],)
    assert reads == [], "and not again for the second"
    assert scan.calls == 0


def test_a_parent_holding_a_socket_is_seen_in_what_was_read_of_it_for_an_earlier_connection(
    connect_twice: Callable[[str], tuple[list[PeerSocket], list[int]]],
) -> None:
    # The HELLO names the forked child; the parent holds both connections: what was read
    # of the parent for the first answers for the second too -- the full scan, both
    peers, pids = connect_twice("fork")
    scan = CountingScan()
    for peer in peers:
        assert peer_socket_pids(dataclasses.replace(peer, hint=pids[1]), scan) == tuple(sorted(pids))
    assert scan.calls == 2
