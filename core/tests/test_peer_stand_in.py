"""The process a connection's hint named, kept where the lookup names no writer.

A client behind a relay has the relay at the far end of its connection: the lookup finds
the relay, which maps no arena, and names no writer.  The process the client's hint (the
native HELLO pid) named is pinned by a pidfd when the connection is first seen; where the
front end's ``stand_in`` takes it for the client's (it maps the arena) while it lives, the
pin is kept as the watch's ``stand_in``, so the client's exit is seen however soon it
comes.  A pin not taken (a process not mapping the arena, one gone before it was asked,
or a lookup that found the writer itself) is closed once the lookup ends, as before.

Every process is a real one: the relay connects (over loopback TCP, or a Unix socket as
``ipc://``) and maps nothing; the writer maps a file standing in for the arena.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from lmcache_tiers.peer_process import PeerProcess, PeerSocket, maps_file, watch_writer_socket
from lmcache_tiers.peer_scan import ConnectionPeers, PeerWatch
from lmcache_tiers.testing.children import FILE_MAPPER, end, ended_at_exit, line_of, start_script

#: connects to argv[1] (a port on 127.0.0.1, or a Unix socket's path), says so, waits
RELAY = """
import socket, sys
if sys.argv[1].isdigit():
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
else:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(sys.argv[1])
print("connected", flush=True)
sys.stdin.read()
"""

#: maps nothing, says so, waits
IDLE = """
import sys
print("up", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with ended_at_exit() as started:
        yield started


@pytest.fixture
def arena() -> Iterator[tuple[str, tuple[int, int]]]:
    path = f"/dev/shm/tiers_stand_in_{os.getpid()}_{os.urandom(4).hex()}"
    with open(path, "wb") as f:
        f.write(bytes(4096))
    found = os.stat(path)
    yield path, (found.st_dev, found.st_ino)
    os.unlink(path)


@pytest.fixture(params=["tcp", "ipc"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    if request.param == "tcp":
        with socket.create_server(("127.0.0.1", 0)) as sock:
            yield sock, str(sock.getsockname()[1])
    else:
        path = str(tmp_path / "peer.sock")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path)
            sock.listen(8)
            yield sock, path


class HeldLookups:
    """The real writer lookup of ``arena``, run only once :attr:`may_scan` is set."""

    def __init__(self, arena: tuple[int, int]) -> None:
        self.may_scan = threading.Event()
        self._scan = partial(watch_writer_socket, arena=arena)

    def __call__(self, peer: PeerSocket) -> Any:
        assert self.may_scan.wait(60)
        return self._scan(peer)


@pytest.fixture
def lookups(arena: tuple[str, tuple[int, int]]) -> Iterator[tuple[ConnectionPeers, HeldLookups]]:
    _, file = arena
    scans = HeldLookups(file)
    connections = ConnectionPeers(
        scans,
        thread_name="tiers-test-peer-scan",
        stand_in=lambda pinned: maps_file(pinned.pids, *file),
    )
    yield connections, scans
    scans.may_scan.set()
    connections.close()


def relayed(listener: tuple[socket.socket, str], processes: list[subprocess.Popen[str]]) -> socket.socket:
    """The server's end of a connection a process mapping nothing holds."""
    sock, address = listener
    relay = start_script(RELAY, address, started=processes)
    assert line_of(relay) == "connected"
    accepted, _ = sock.accept()
    return accepted


def mapping(
    arena: tuple[str, tuple[int, int]], processes: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    writer = start_script(FILE_MAPPER, arena[0], started=processes)
    assert line_of(writer) == "mapped"
    return writer


def settled(watch: PeerWatch | None) -> PeerWatch:
    assert watch is not None
    assert watch.armed.wait(30), "the lookup did not end"
    return watch


def test_the_hinted_process_mapping_the_arena_stands_in_behind_a_relay(
    listener: tuple[socket.socket, str],
    arena: tuple[str, tuple[int, int]],
    processes: list[subprocess.Popen[str]],
    lookups: tuple[ConnectionPeers, HeldLookups],
) -> None:
    connections, scans = lookups
    writer = mapping(arena, processes)
    with relayed(listener, processes) as accepted:
        watch = connections.watch(accepted.fileno(), hint=writer.pid)
        scans.may_scan.set()
        settled(watch)
        assert watch.process is None and watch.not_writer, "the relay is not the writer"
        stand_in = watch.stand_in
        assert isinstance(stand_in, PeerProcess) and stand_in.pids == (writer.pid,)
        assert watch.pin is None and not stand_in.exited()
        end(writer)  # reaped: its pid names nothing now, the pidfd still tells
        assert stand_in.exited()


def test_a_hinted_process_not_mapping_the_arena_does_not_stand_in(
    listener: tuple[socket.socket, str],
    arena: tuple[str, tuple[int, int]],
    processes: list[subprocess.Popen[str]],
    lookups: tuple[ConnectionPeers, HeldLookups],
) -> None:
    connections, scans = lookups
    other = start_script(IDLE, started=processes)
    assert line_of(other) == "up"
    with relayed(listener, processes) as accepted:
        watch = connections.watch(accepted.fileno(), hint=other.pid)
        scans.may_scan.set()
        settled(watch)
        assert watch.stand_in is None and watch.pin is None


def test_a_hinted_process_gone_before_the_lookup_does_not_stand_in(
    listener: tuple[socket.socket, str],
    arena: tuple[str, tuple[int, int]],
    processes: list[subprocess.Popen[str]],
    lookups: tuple[ConnectionPeers, HeldLookups],
) -> None:
    """Nothing can tell any more that it mapped the arena: the fences wait for a commit."""
    connections, scans = lookups
    writer = mapping(arena, processes)
    with relayed(listener, processes) as accepted:
        watch = connections.watch(accepted.fileno(), hint=writer.pid)
        end(writer)
        scans.may_scan.set()
        settled(watch)
        assert watch.stand_in is None and watch.pin is None and not watch.exited()


def test_no_stand_in_where_the_lookup_names_the_writer(
    listener: tuple[socket.socket, str],
    arena: tuple[str, tuple[int, int]],
    processes: list[subprocess.Popen[str]],
    lookups: tuple[ConnectionPeers, HeldLookups],
) -> None:
    """A client the lookup finds (here: told it holds the connection) needs none."""
    connections, scans = lookups
    writer = mapping(arena, processes)
    with relayed(listener, processes) as accepted:
        scans._scan = lambda peer: PeerProcess((writer.pid,), [os.pidfd_open(writer.pid)])
        watch = connections.watch(accepted.fileno(), hint=writer.pid)
        scans.may_scan.set()
        settled(watch)
        assert watch.process is not None and watch.stand_in is None and watch.pin is None
