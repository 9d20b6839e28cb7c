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

import contextlib
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from lmcache_tiers.peer_process import PeerProcess, PeerSocket, maps_file, watch_writer_socket
from lmcache_tiers.peer_scan import ConnectionPeers, PeerWatch
from lmcache_tiers.testing.children import FILE_MAPPER, end, line_of, start_script

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
    """The real writer lookup of ``arena``, run only once :attr:`may_scan` is set, and the
    front end's ``stand_in`` question, asked only once :attr:`may_ask` is set."""

    def __init__(self, arena: tuple[int, int]) -> None:
        self.may_scan = threading.Event()
        self.may_ask = threading.Event()
        self._arena = arena
        self._scan = partial(watch_writer_socket, arena=arena)

    def __call__(self, peer: PeerSocket) -> Any:
        assert self.may_scan.wait(60)
        return self._scan(peer)

    def stand_in(self, pinned: PeerProcess) -> bool:
        assert self.may_ask.wait(60)
        return maps_file(pinned.pids, *self._arena)


@pytest.fixture
def lookups(arena: tuple[str, tuple[int, int]]) -> Iterator[tuple[ConnectionPeers, HeldLookups]]:
    _, file = arena
    scans = HeldLookups(file)
    connections = ConnectionPeers(
        scans,
        thread_name="tiers-test-peer-scan",
        stand_in=scans.stand_in,
    )
    yield connections, scans
    scans.may_ask.set()
    scans.may_scan.set()
    connections.close()


@dataclass
class StandInCase:
    """A listener, the arena, the processes started and the held lookups of one test."""

    listener: tuple[socket.socket, str]
    arena: tuple[str, tuple[int, int]]
    processes: list[subprocess.Popen[str]]
    connections: ConnectionPeers
    scans: HeldLookups

    def mapping(self) -> subprocess.Popen[str]:
        """A process mapping the arena."""
        writer = start_script(FILE_MAPPER, self.arena[0], started=self.processes)
        assert line_of(writer) == "mapped"
        return writer

    @contextlib.contextmanager
    def watched_behind_a_relay(
        self, hint: int, before_the_lookup: Callable[[], object] = lambda: None
    ) -> Iterator[PeerWatch]:
        """The watch of a connection a process mapping nothing holds, told ``hint``, once
        its lookup (let run, and the pin asked, after ``before_the_lookup``) ended."""
        sock, address = self.listener
        relay = start_script(RELAY, address, started=self.processes)
        assert line_of(relay) == "connected"
        accepted, _ = sock.accept()
        with accepted:
            watch = self.connections.watch(accepted.fileno(), hint=hint)
            assert watch is not None
            before_the_lookup()
            self.scans.may_ask.set()
            self.scans.may_scan.set()
            assert watch.armed.wait(30), "the lookup did not end"
            yield watch


@pytest.fixture
def case(
    listener: tuple[socket.socket, str],
    arena: tuple[str, tuple[int, int]],
    processes: list[subprocess.Popen[str]],
    lookups: tuple[ConnectionPeers, HeldLookups],
) -> StandInCase:
    return StandInCase(listener, arena, processes, *lookups)


def test_the_hinted_process_mapping_the_arena_stands_in_behind_a_relay(case: StandInCase) -> None:
    writer = case.mapping()
    with case.watched_behind_a_relay(writer.pid) as watch:
        assert watch.process is None and watch.not_writer, "the relay is not the writer"
        stand_in = watch.stand_in
        assert isinstance(stand_in, PeerProcess) and stand_in.pids == (writer.pid,)
        assert watch.pin is None and not stand_in.exited()
        end(writer)  # reaped: its pid names nothing now, the pidfd still tells
        assert stand_in.exited()


def test_a_hinted_process_not_mapping_the_arena_does_not_stand_in(case: StandInCase) -> None:
    other = start_script(IDLE, started=case.processes)
    assert line_of(other) == "up"
    with case.watched_behind_a_relay(other.pid) as watch:
        assert watch.stand_in is None and watch.pin is None


def test_a_hinted_process_gone_before_the_lookup_does_not_stand_in(case: StandInCase) -> None:
    """Gone before anything asked it: nothing can tell any more that it mapped the arena,
    so the fences wait for a commit."""
    writer = case.mapping()
    with case.watched_behind_a_relay(writer.pid, before_the_lookup=lambda: end(writer)) as watch:
        assert watch.stand_in is None and watch.pin is None and not watch.exited()


def test_no_stand_in_where_the_lookup_names_the_writer(case: StandInCase) -> None:
    """A client the lookup finds (here: told it holds the connection) needs none."""
    writer = case.mapping()
    case.scans._scan = lambda peer: PeerProcess((writer.pid,), [os.pidfd_open(writer.pid)])
    with case.watched_behind_a_relay(writer.pid) as watch:
        assert watch.process is not None and watch.stand_in is None and watch.pin is None
