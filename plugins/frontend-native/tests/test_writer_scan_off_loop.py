"""The process of a reserving client's connection is looked up off the loop thread, and
a pending lookup keeps the fence.

Over loopback TCP the process is found by a scan of every process's descriptors, then
its maps are read for the arena: on the loop thread, at each connection's first
STORE_RESERVE, a slow scan held every other client's requests up.  The scan runs on a
worker: the scanner is the server's own (``WriterProcesses.watch_writer``) behind a gate these tests
hold, so the loop can be seen answering while it waits, and the fence of a writer that
exited while its lookup was pending seen held until the lookup ends.  Writers are real
processes over loopback TCP (``test_writer_kernel_pid``).
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest
from native_fence_support import SHORT_TTL
from native_keys import leases_of
from native_stop import wait_for
from test_writer_kernel_pid import (
    arena_path,
    fenced,
    older_client_stores_across_a_drop,
    reserve_as,
    sweeps_after_now,
)

from lmcache_tiers.client import Client
from lmcache_tiers.plugin import PeerProcess, PeerSocket
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.children import FILE_MAPPER, end, says
from lmcache_tiers.testing.children import start_script as start
from lmcache_tiers.testing.peer_scans import GATE_S, GatedScanner


def writers_of(server: TiersServer) -> Any:
    frontend: Any = server.frontends[0]
    return frontend.handlers.writers


def gated(server: TiersServer) -> GatedScanner:
    scanner = GatedScanner(writers_of(server).scan)
    writers_of(server).scan = scanner
    return scanner


def failures(server: TiersServer) -> Any:
    return server.frontends[0].stats().failures


def test_the_loop_answers_while_a_scan_waits_and_the_fence_holds_until_it_ends(
    make_server: Any,
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = make_server(**SHORT_TTL)
    scanner = gated(server)
    try:
        # reserved (answered), expired and fenced while its lookup waits
        writer = reserve_as(server, os.getpid(), processes)
        assert scanner.scanned.wait(GATE_S)
        with Client(server.endpoint) as other:
            other.ping()
            end(writer)  # exits while its lookup is pending
            wait_for_sweeps = sweeps_after_now(server, monkeypatch)
            wait_for_sweeps()
            # the pending lookup counts as a live writer (its HELLO pid is not asked)
            assert fenced(server) == 1, "the fence was lifted while the writer's lookup was pending"
            other.ping()
        scanner.gate.set()
        wait_for(lambda: fenced(server) == 0, "the exited writer's fence lifted once armed")
        assert leases_of(server)["reclaimed_writer_done"] == 1
        assert scanner.threads == ["tiers-native-peer-scan"]
    finally:
        scanner.gate.set()


def test_a_failed_lookup_is_counted_and_the_hello_pid_stands_in(
    make_server: Any,
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = make_server(**SHORT_TTL)
    calls: list[PeerSocket] = []

    def failing(peer: PeerSocket) -> PeerProcess | None:
        calls.append(peer)
        raise OSError("no /proc")

    writers_of(server).scan = failing
    named = start(FILE_MAPPER, arena_path(server))  # maps the arena, as a client would
    processes.append(named)
    says(named, "mapped")
    writer = reserve_as(server, named.pid, processes)
    wait_for(lambda: failures(server)["peer_scan_failed"] == 1, "the failed lookup counted")
    server.storage.l1.expire_locks(time.monotonic() + 3600.0)
    sweeps_after_now(server, monkeypatch)()
    assert fenced(server) == 1  # the process its HELLO named lives
    end(named)
    wait_for(lambda: fenced(server) == 0, "the fence lifted at the exit of the HELLO pid's process")
    assert leases_of(server)["reclaimed_writer_done"] == 1
    assert len(calls) == 1
    assert failures(server)["peer_scan_failed"] == 1
    end(writer)


def test_a_commit_after_a_drop_is_tied_while_the_lookups_wait(
    server: TiersServer,
    processes: list[subprocess.Popen[str]],
) -> None:
    """The worker is held on the dropped connection's lookup: the commit on the new one
    settles both on the loop thread (once each) and is taken as the same process's."""
    scanner = gated(server)
    try:
        older_client_stores_across_a_drop(server, processes)
        assert scanner.threads[0] == "tiers-native-peer-scan"
        assert "tiers-native-peer-scan" not in scanner.threads[1:]
    finally:
        scanner.gate.set()
