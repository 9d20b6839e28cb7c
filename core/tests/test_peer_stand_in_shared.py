"""The stand-ins of one live process's connections are one watch: one pidfd per process.

A client whose lookup names no writer (behind a relay, or closed before its lookup ran,
as a short-lived engine connection is) has the process its hint named kept as the
connection's ``stand_in``.  Each was kept with the pidfd pinned for its own connection,
held as long as the connection was remembered: a client process opening and closing
connections while it lived grew the server's descriptors by one per connection.  Like
the watches of the writers the lookup names, a stand-in is shared by the connections of
its process while every process it names lives, and only then: a pid of one that exited
may name another process by now.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_tiers import peer_scan
from lmcache_tiers.peer_process import PeerProcess, PeerSocket, maps_file, watch_writer_socket
from lmcache_tiers.peer_scan import ConnectionPeers, PeerWatch
from lmcache_tiers.testing.children import FILE_MAPPER, end, line_of, start_script

CONNECTIONS = 6


@pytest.fixture
def arena() -> Iterator[tuple[str, tuple[int, int]]]:
    path = f"/dev/shm/tiers_stand_in_shared_{os.getpid()}_{os.urandom(4).hex()}"
    with open(path, "wb") as f:
        f.write(bytes(4096))
    found = os.stat(path)
    yield path, (found.st_dev, found.st_ino)
    os.unlink(path)


class GatedLookups:
    """The real writer lookup of ``arena``, run only once :attr:`may_scan` is set."""

    def __init__(self, arena: tuple[int, int]) -> None:
        self.may_scan = threading.Event()
        self._arena = arena

    def __call__(self, peer: PeerSocket) -> Any:
        assert self.may_scan.wait(60)
        return watch_writer_socket(peer, self._arena)


def own_pidfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return count


def closed_before_their_lookups(
    connections: ConnectionPeers, scans: GatedLookups, hint: int
) -> list[PeerWatch]:
    """The watches of ``CONNECTIONS`` loopback connections told ``hint``, each closed by
    its client before its lookup ran, once those lookups ended."""
    watches: list[PeerWatch] = []
    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        try:
            for _ in range(CONNECTIONS):
                with socket.create_connection(listener.getsockname()):  # closed at once
                    server_end, _ = listener.accept()
                    accepted.append(server_end)
                    watch = connections.watch(server_end.fileno(), hint=hint)
                    assert watch is not None
                    watches.append(watch)
            scans.may_scan.set()
            for watch in watches:
                assert watch.armed.wait(30), "a lookup did not end"
        finally:
            for server_end in accepted:
                server_end.close()
    return watches


def test_the_connections_of_one_live_process_share_its_stand_in(
    arena: tuple[str, tuple[int, int]], processes: list[subprocess.Popen[str]]
) -> None:
    path, file = arena
    writer = start_script(FILE_MAPPER, path, started=processes)
    assert line_of(writer) == "mapped"
    scans = GatedLookups(file)
    connections = ConnectionPeers(scans, stand_in=lambda pinned: maps_file(pinned.pids, *file))
    try:
        pidfds_before = own_pidfds()
        watches = closed_before_their_lookups(connections, scans, writer.pid)
        stand_ins = {id(watch.stand_in) for watch in watches}
        assert all(watch.stand_in is not None for watch in watches), "the writer stands in for each"
        assert len(stand_ins) == 1, f"{len(stand_ins)} stand-ins of one process"
        assert own_pidfds() <= pidfds_before + 1
        end(writer)
        assert all(watch.stand_in is not None and watch.stand_in.exited() for watch in watches)
    finally:
        connections.close()


def test_a_stand_in_whose_process_exited_is_not_shared(
    arena: tuple[str, tuple[int, int]],
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's reuse of the exited writer's pid is stood in for by the pin: the later
    connection's hint names that pid, pinned through a pidfd of another live writer."""
    path, file = arena
    earlier, newcomer = (start_script(FILE_MAPPER, path, started=processes) for _ in range(2))
    assert line_of(earlier) == line_of(newcomer) == "mapped"
    scans = GatedLookups(file)
    connections = ConnectionPeers(scans, stand_in=lambda pinned: True)
    try:
        (first, *_) = closed_before_their_lookups(connections, scans, earlier.pid)
        end(earlier)
        assert first.stand_in is not None and first.stand_in.exited()
        monkeypatch.setattr(
            peer_scan, "_pin", lambda hint: PeerProcess((hint,), [os.pidfd_open(newcomer.pid)])
        )
        (later, *_) = closed_before_their_lookups(connections, scans, earlier.pid)
        assert later.stand_in is not None and later.stand_in is not first.stand_in
        assert not later.stand_in.exited(), "the writer of the later connection lives"
        end(newcomer)
        assert later.stand_in.exited()
    finally:
        connections.close()
