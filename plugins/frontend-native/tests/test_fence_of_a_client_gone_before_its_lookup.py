"""The fence of a TCP client that is gone before the server looked up its process.

Over loopback TCP the process behind a connection is looked up by the scan worker after
the connection's first STORE_RESERVE.  A client killed before that lookup ran was not
found (its socket had gone with it), and its HELLO pid, asked later, named no process
mapping the arena (gone, or a zombie): the client counted as one whose exit cannot be
seen, and its expired reservation stayed fenced until the server stopped.  The process
its HELLO named is now pinned (a pidfd) when the connection's first request is handled;
a lookup finding the client's socket held by no process takes that process as the
writer once it has exited, so the fence lifts.  A client alive -- its connection open,
or closed while it still maps the arena -- keeps its fence until it exits.  Each client
is a process of its own; the scan worker is held until the test lets it run.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from native_fence_support import CHUNK, SHORT_TTL
from native_keys import leases_of
from native_stop import wait_for
from test_writer_kernel_pid import sweeps_after_now

from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.children import end, says
from lmcache_tiers.testing.children import start_script as start

#: the thread scanning for clients' processes, off the loop thread
SCAN_WORKER = "tiers-native-peer-scan"

#: greets the server (its own pid), reserves one chunk and says so; with argv[3] "close"
#: it then closes its connection (not its mapping of the arena) and says so; then stalls
WRITER = """
import sys
from lmcache_tiers.client import Client
from lmcache_tiers.client.connection import Connection
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p
client = Client(sys.argv[1])
assert client._segment is not None, "the writer did not map the arena"
key = ObjectKey("gone-before-lookup", 0, b"writer00")
client._call(p.StoreReserve(0, "", [key], [int(sys.argv[2])]), p.StoreReserveReply)
print("reserved", flush=True)
if sys.argv[3] == "close":
    Connection.close(client)
    print("closed", flush=True)
sys.stdin.read()
"""


def fenced(server: TiersServer) -> int:
    return leases_of(server)["fenced_extents"]


def held_scans(server: TiersServer, stack: ExitStack) -> threading.Event:
    """The real lookups, run by the scan worker only once the returned event is set."""
    writers = server.frontends[0].handlers.writers
    scan = writers.scan
    worker_may_scan = threading.Event()
    stack.callback(worker_may_scan.set)  # before the server stops: its close joins the worker

    def held(peer: Any) -> Any:
        if threading.current_thread().name == SCAN_WORKER:
            worker_may_scan.wait()
        return scan(peer)

    writers.scan = held
    return worker_may_scan


def lookups_ended(server: TiersServer) -> None:
    connections = server.frontends[0].handlers.writers.connections
    wait_for(lambda: all(watch.armed.is_set() for _, watch in connections._of.values()), "every lookup ended")


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def test_a_client_killed_before_its_lookup_has_its_fence_lifted(
    make_server: Any, stack: ExitStack, processes: list[subprocess.Popen[str]]
) -> None:
    server = make_server(**SHORT_TTL)
    worker_may_scan = held_scans(server, stack)
    writer = start(WRITER, server.endpoint, str(CHUNK), "stay")
    processes.append(writer)
    says(writer, "reserved")
    end(writer)  # killed and reaped, as an engine's parent would
    worker_may_scan.set()
    lookups_ended(server)
    # Its reservation expires and is given back: fenced or not, depending on whether the
    # client's exit is seen before L1 reaps it.
    sessions = server.frontends[0].handlers.sessions
    wait_for(
        lambda: not any(session.writes or session.fenced for session in sessions),
        "the killed client's reservation given back",
    )
    wait_for(lambda: server.storage.l1.used_bytes == 0, "L1 empty again")
    assert fenced(server) == 0


@pytest.mark.parametrize("connection", ["open", "closed"])
def test_a_live_client_keeps_its_fence_until_it_exits(
    make_server: Any,
    stack: ExitStack,
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    connection: str,
) -> None:
    """Stalled past the write TTL, alive: its connection open (found by the lookup), or
    closed before the lookup ran while it still maps the arena (its HELLO pid stands in)."""
    server = make_server(**SHORT_TTL)
    worker_may_scan = held_scans(server, stack)
    writer = start(WRITER, server.endpoint, str(CHUNK), "close" if connection == "closed" else "stay")
    processes.append(writer)
    says(writer, "reserved")
    if connection == "closed":
        says(writer, "closed")
    worker_may_scan.set()
    lookups_ended(server)
    wait_for(lambda: fenced(server) == 1, "the expired reservation fenced")
    wait_for_sweeps = sweeps_after_now(server, monkeypatch)
    wait_for_sweeps()
    assert fenced(server) == 1, "the fence was lifted while its writer lived"
    end(writer)
    wait_for(lambda: fenced(server) == 0, "the fence of the exited writer lifted")
    assert leases_of(server)["reclaimed_writer_done"] == 1
