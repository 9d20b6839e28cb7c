"""Each connection's process, looked up once and off the caller's thread.

The scanner is the real one (``watch_peer_socket``) behind a gate these tests hold, so a
pending lookup can be seen keeping its process "alive" after the process exited, and a
lookup run at once (``scan_now``) seen settling a watch the worker then leaves alone.
Clients are real processes connected over a Unix socket.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from lmcache_tiers import peer_scan
from lmcache_tiers.peer_process import PeerProcess, PeerSocket, watch_peer_socket, watch_writer_socket
from lmcache_tiers.peer_scan import ConnectionPeers
from lmcache_tiers.testing.peer_scans import GATE_S, GatedScanner

#: connects to the Unix socket argv[1], says so, then waits to be killed
CLIENT = """
import socket, sys, time
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
print("connected", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "peer.sock")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path)
        sock.listen(8)
        yield sock, path


@pytest.fixture
def clients(listener: tuple[socket.socket, str]) -> Iterator[Any]:
    sock, path = listener
    started: list[tuple[subprocess.Popen[str], socket.socket]] = []

    def connect() -> tuple[subprocess.Popen[str], socket.socket]:
        process = subprocess.Popen([sys.executable, "-c", CLIENT, path], stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "connected"
        accepted, _ = sock.accept()
        started.append((process, accepted))
        return process, accepted

    yield connect
    for process, accepted in started:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
        accepted.close()


@pytest.fixture
def peers() -> Iterator[Any]:
    made: list[ConnectionPeers] = []
    scanners: list[GatedScanner] = []

    def make(scanner: Any, **kwargs: Any) -> ConnectionPeers:
        made.append(ConnectionPeers(scanner, **kwargs))
        if isinstance(scanner, GatedScanner):
            scanners.append(scanner)
        return made[-1]

    yield make
    for scanner in scanners:
        scanner.gate.set()
    for each in made:
        each.close()


def test_a_pending_lookup_keeps_its_process_alive_until_armed(clients: Any, peers: Any) -> None:
    scanner = GatedScanner()
    connections = peers(scanner)
    process, accepted = clients()
    watch = connections.watch(accepted.fileno())
    assert watch is not None
    assert scanner.scanned.wait(GATE_S)  # found while the client lived, not armed yet
    process.kill()
    process.wait()
    assert not watch.exited()  # pending: the fence waiting for it stays
    assert connections.watch(accepted.fileno()) is watch  # one lookup per connection
    scanner.gate.set()
    assert watch.armed.wait(GATE_S)
    assert watch.process is not None and watch.process.pids == (process.pid,)
    assert watch.exited()
    assert scanner.threads == ["tiers-peer-scan"]


def test_scan_now_settles_a_queued_watch_and_the_worker_leaves_it(clients: Any, peers: Any) -> None:
    scanner = GatedScanner()
    connections = peers(scanner)
    _, first_accepted = clients()
    second, second_accepted = clients()
    held = connections.watch(first_accepted.fileno())
    assert scanner.scanned.wait(GATE_S)  # the worker is held: the next one waits in the queue
    queued = connections.watch(second_accepted.fileno())
    assert held is not None and queued is not None and not queued.armed.is_set()
    connections.scan_now(queued)
    assert queued.armed.is_set() and queued.process is not None
    assert queued.process.pids == (second.pid,)
    scanner.gate.set()
    assert held.armed.wait(GATE_S)
    connections.close()  # the worker has run what was queued
    assert scanner.threads == ["tiers-peer-scan", threading.current_thread().name]
    assert connections.take_failures() == Counter()


def test_a_lookup_settled_at_once_is_not_given_up_at_the_stop(peers: Any) -> None:
    """Still queued when the stop comes, but already armed by scan_now: nothing was given
    up, so nothing is counted so."""
    scanner = GatedScanner()
    connections = peers(scanner)
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        held = connections.watch(pairs[0][0].fileno())
        assert held is not None and scanner.scanned.wait(GATE_S)  # the worker is held
        queued = connections.watch(pairs[1][0].fileno())
        assert queued is not None
        connections.scan_now(queued)
        assert queued.armed.is_set()
        connections.close()  # the queued one is dropped from the queue, the held one left
        assert connections.take_failures() == Counter()
    finally:
        scanner.gate.set()
        for pair in pairs:
            for end in pair:
                end.close()


def test_a_closed_connection_is_forgotten_once_its_number_is_another_connections(peers: Any) -> None:
    """Its watch (and the pidfd in it) is not kept for the thousands of connections seen
    since: a descriptor number names one connection at a time."""
    connections = peers(watch_peer_socket)
    first, second = socket.socketpair(), socket.socketpair()
    try:
        number = first[0].fileno()
        closed = connections.watch(number)
        assert closed is not None and closed.armed.wait(GATE_S)
        gone = weakref.ref(closed)
        os.dup2(second[0].fileno(), number)  # the number now names another connection
        now = connections.watch(number)
        assert now is not None and now is not closed
        del closed
        # The worker's own frame may hold the last watch it settled until it takes the
        # next one from its queue: let go of within the gate's time, not kept
        deadline = time.monotonic() + GATE_S
        gc.collect()
        while gone() is not None:
            assert time.monotonic() < deadline, "the watch of the closed connection is kept"
            time.sleep(0.01)
            gc.collect()
        assert connections.watch(number) is now  # the new connection is remembered
    finally:
        for pair in (first, second):
            for end in pair:
                end.close()


def test_a_failed_lookup_is_counted_once_and_armed_unknown(clients: Any, peers: Any) -> None:
    calls: list[PeerSocket] = []

    def failing(peer: PeerSocket) -> PeerProcess | None:
        calls.append(peer)
        raise OSError("no /proc")

    connections = peers(failing, failed="test_scan_failed", given_up="test_scan_given_up")
    _, accepted = clients()
    watch = connections.watch(accepted.fileno())
    assert watch is not None and watch.armed.wait(GATE_S)
    assert watch.process is None and not watch.exited()
    assert connections.watch(accepted.fileno()) is watch  # remembered: not scanned again
    counted: Counter[str] = Counter()
    connections.count_failures(lambda reason, n: counted.update({reason: n}), lambda reason: "kept")
    assert counted == {"test_scan_failed": 1}
    assert len(calls) == 1


def test_lookups_past_the_bound_are_given_up_and_counted(peers: Any) -> None:
    """Those past ``max_pending`` are given up (counted), pending for ever, and looked up
    again at their connection's next message; those still waiting at the stop too."""
    scanner = GatedScanner()
    connections = peers(scanner, max_pending=1)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        running = connections.watch(pairs[0][0].fileno())
        assert scanner.scanned.wait(GATE_S)  # the worker holds it: the queue is empty
        queued = connections.watch(pairs[1][0].fileno())
        given_up = connections.watch(pairs[2][0].fileno())
        assert running is not None and queued is not None and given_up is not None
        assert connections.take_failures() == {"peer_scan_given_up": 1}
        assert not given_up.exited() and not given_up.armed.is_set()
        assert connections.watch(pairs[2][0].fileno()) is not given_up  # asked again
        assert connections.take_failures() == {"peer_scan_given_up": 1}
        scanner.gate.set()
        assert running.armed.wait(GATE_S)
        assert running.process is not None and not running.exited()  # this process lives
        connections.close()
        failures = connections.take_failures()
        assert queued.armed.is_set() or failures == {"peer_scan_given_up": 1}
    finally:
        scanner.gate.set()
        for pair in pairs:
            for end in pair:
                end.close()


def test_connections_of_one_process_share_its_watch(peers: Any, listener: Any) -> None:
    connections = peers(watch_peer_socket)
    with socket.socket(socket.AF_UNIX) as mine:  # this process, twice
        mine.connect(listener[1])
        near, _ = listener[0].accept()
        with socket.socket(socket.AF_UNIX) as again:
            again.connect(listener[1])
            other, _ = listener[0].accept()
            with near, other:
                one, two = connections.watch(near.fileno()), connections.watch(other.fileno())
                assert one is not None and two is not None and one is not two
                assert one.armed.wait(GATE_S) and two.armed.wait(GATE_S)
                assert one.process is not None and one.process is two.process


#: connects to the Unix socket argv[1] after mapping the file argv[2], as a shared-memory
#: writer maps the arena, then waits to be killed
MAPPING_CLIENT = """
import mmap, socket, sys, time
with open(sys.argv[2], "r+b") as f:
    mapped = mmap.mmap(f.fileno(), 4096)
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
print("connected", flush=True)
time.sleep(3600)
"""


def test_a_process_not_mapping_the_arena_is_not_the_writer(
    clients: Any, listener: tuple[socket.socket, str], peers: Any, tmp_path: Path
) -> None:
    """A relay holds the connection but copies nothing: its exit must lift no fence."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    info = os.stat(arena)
    scanner = partial(watch_writer_socket, arena=(info.st_dev, info.st_ino))
    connections = peers(scanner, not_writer="test_not_writer")
    relay, relayed = clients()  # maps nothing
    writer = subprocess.Popen(
        [sys.executable, "-c", MAPPING_CLIENT, listener[1], str(arena)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "connected"
        written, _ = listener[0].accept()
        with written:
            of_relay = connections.watch(relayed.fileno())
            of_writer = connections.watch(written.fileno())
            assert of_relay is not None and of_relay.armed.wait(GATE_S)
            assert of_writer is not None and of_writer.armed.wait(GATE_S)
            assert of_relay.process is None and of_relay.not_writer
            assert of_writer.process is not None and of_writer.process.pids == (writer.pid,)
            assert not of_writer.not_writer
            relay.kill()
            relay.wait()
            assert not of_relay.exited()  # the fence waiting for it stays
            assert connections.take_failures() == Counter({"test_not_writer": 1})
    finally:
        writer.kill()
        writer.wait()
        if writer.stdout is not None:
            writer.stdout.close()


def test_a_client_in_a_foreign_pid_namespace_is_counted_once_and_never_scanned(
    clients: Any, peers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SO_PEERCRED`` names pid 0 for a client whose process has no pid in the server's
    namespace (injected here: the end-to-end case is the native front end's
    test_writer_foreign_namespace.py, under ``unshare``)."""
    import lmcache_tiers.peer_scan as peer_scan

    scanned: list[PeerSocket] = []

    def scanner(peer: PeerSocket) -> PeerProcess | None:
        scanned.append(peer)
        return None

    monkeypatch.setattr(peer_scan, "peer_socket", lambda fd: PeerSocket(foreign=True))
    connections = peers(scanner, foreign="test_foreign")
    _, accepted = clients()
    watch = connections.watch(accepted.fileno())
    assert watch is not None and watch.armed.is_set() and watch.foreign
    assert watch.process is None and not watch.exited()
    assert connections.watch(accepted.fileno()) is watch  # one count per connection
    counted: Counter[str] = Counter()
    connections.count_failures(lambda reason, n: counted.update({reason: n}), lambda reason: "kept")
    assert counted == {"test_foreign": 1}
    assert scanned == []


def test_a_lookup_settled_by_both_threads_at_once_is_counted_once(clients: Any, peers: Any) -> None:
    """scan_now and the worker may both scan a pending connection; only the one arming its
    watch counts what it found (here: no writer), or one connection counted twice."""
    both_scanning = threading.Barrier(2, timeout=GATE_S)

    def relay_scanner(peer: PeerSocket) -> PeerProcess | None:
        both_scanning.wait()  # each thread is past its armed check before either arms
        found = PeerProcess((os.getpid(),), [])
        found.writer = False
        return found

    connections = peers(relay_scanner, not_writer="test_not_writer")
    _, accepted = clients()
    watch = connections.watch(accepted.fileno())  # the worker scans it
    assert watch is not None
    connections.scan_now(watch)  # and so does this thread, meeting it in the scanner
    assert watch.armed.is_set() and watch.not_writer
    connections.close()
    worker = connections._worker
    assert worker is not None
    worker.join(GATE_S)  # the worker's settle, past the scanner, has ended
    assert not worker.is_alive()
    assert connections.take_failures() == Counter({"test_not_writer": 1})


def test_a_connection_just_seen_is_scanned_only_once_the_request_that_saw_it_had_its_turn(
    clients: Any, peers: Any
) -> None:
    # The loop thread is still answering the request a connection came with: its scan
    # waits out SCAN_DELAY_S from when it was seen (the GIL and a core stay with that reply)
    scanned_at: list[float] = []

    def scanner(peer: PeerSocket) -> PeerProcess | None:
        scanned_at.append(time.monotonic())
        return watch_peer_socket(peer)

    connections = peers(scanner)
    process, accepted = clients()
    watch = connections.watch(accepted.fileno())
    assert watch is not None and watch.armed.wait(GATE_S)
    assert watch.process is not None and watch.process.pids == (process.pid,)
    assert len(scanned_at) == 1 and scanned_at[0] >= watch.seen_at + peer_scan.SCAN_DELAY_S
