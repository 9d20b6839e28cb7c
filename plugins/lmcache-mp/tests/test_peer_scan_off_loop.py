"""A connection's process is looked up off the loop thread, and a pending lookup keeps
the fence.

Over loopback TCP the process of a connection is found by a scan of every process's
descriptors; on the loop thread, a slow scan held every client's requests up, and a
client reconnecting for each store made the loop pay one per connection.  The scan runs
on a worker: the scanner is the real one (``watch_peer_socket``) behind a gate these
tests hold, so the loop can be seen answering while it waits, and the fence of a writer
that exited while its lookup was pending can be seen held until the lookup ends.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from lmcache_plugin_lmcache_mp import peers
from lmcache_plugin_lmcache_mp.peers import ConnectionProcesses
from mp_counts import mp_stats
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, mp_address, tokens_of, wait_for
from writer_processes import fenced_extents, start_writer, transfers_of

from lmcache_tiers.plugin import PeerProcess, PeerSocket
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.peer_scans import GATE_S, GatedScanner

OTHER = Registration(instance_id=1001)
#: a write TTL short enough for the server's own sweep and reap to expire a reservation
SHORT_TTL: dict[str, Any] = {"l1_write_ttl_s": 1.0, "l1_lock_ttl_s": 1.0}


@pytest.fixture
def server(make_mp_server: Any) -> TiersServer:
    made: TiersServer = make_mp_server(**SHORT_TTL, host="127.0.0.1")
    return made


def prepare(client: MPClient, sequence: int) -> None:
    key = Key(tokens_of(sequence), f"next-{sequence}", worker_id=0, end=CHUNK_TOKENS)
    assert client.call("prepare_store", key.encode(), OTHER.instance_id)["context"]["slots"]


def test_the_loop_answers_while_a_scan_waits_and_the_fence_holds_until_it_ends(
    server: TiersServer, writers: list[Any]
) -> None:
    transfers = transfers_of(server)
    scanner = GatedScanner()
    transfers.peers = ConnectionProcesses(scan=scanner)
    writer = start_writer(server, 1000, 1, writers)  # answered while its scan waits
    assert scanner.scanned.wait(GATE_S)  # found while the writer lived, not armed yet
    with MPClient(mp_address(server)) as other:
        assert other.call("ping", None) is True
        wait_for(lambda: fenced_extents(server) == 1, "the expired reservation fenced")
        writer.kill()  # exits while its lookup is pending
        writer.wait()
        # A reservation prepared after the exit, expired and counted by a sweep: that
        # sweep looked at the exited writer's fence after counting it (sweep's order).
        other.register(OTHER)
        prepare(other, 2)
        wait_for(lambda: mp_stats(server).failures["mp_transfer_expired"] >= 2, "a sweep after the exit")
        # the pending lookup counts as a live writer
        assert len(transfers.writes.fenced) == 2
        assert mp_stats(server).failures["mp_fence_writer_exited"] == 0
        assert other.call("ping", None) is True
        scanner.gate.set()
        wait_for(lambda: len(transfers.writes.fenced) == 1, "the exited writer's fence lifted once armed")
        assert mp_stats(server).failures["mp_fence_writer_exited"] == 1
        # the other one is this process, the server's own: never waited for
        assert len(scanner.calls) == 2


def test_a_connection_is_looked_up_once_pending_or_done(server: TiersServer) -> None:
    """Stores on one connection, some while its lookup is pending: one scan; a second
    connection: its own."""
    transfers = transfers_of(server)
    scanner = GatedScanner()
    transfers.peers = ConnectionProcesses(scan=scanner)
    with MPClient(mp_address(server)) as client:
        client.register(OTHER)
        prepare(client, 1)
        assert scanner.scanned.wait(GATE_S)
        prepare(client, 2)
        prepare(client, 3)
        scanner.gate.set()
        prepare(client, 4)
        with MPClient(mp_address(server)) as second:
            second.register(OTHER)
            prepare(second, 5)
            prepare(second, 6)
            wait_for(lambda: len(scanner.calls) == 2, "the second connection's lookup")
        prepare(client, 7)
    assert len(scanner.calls) == 2


def test_a_failed_lookup_is_counted_once_per_connection(server: TiersServer) -> None:
    calls: list[PeerSocket] = []

    def failing(peer: PeerSocket) -> PeerProcess | None:
        calls.append(peer)
        raise OSError("no /proc")

    transfers_of(server).peers = ConnectionProcesses(scan=failing)
    with MPClient(mp_address(server)) as client:
        client.register(OTHER)
        prepare(client, 1)
        wait_for(lambda: mp_stats(server).failures["mp_peer_scan_failed"] == 1, "the failure counted")
        prepare(client, 2)  # the failure is remembered: not scanned again
        assert client.call("ping", None) is True
    assert len(calls) == 1


def test_lookups_past_the_bound_are_given_up_under_the_mp_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound and the reason are the LMCache front end's (what a given-up lookup does
    is core's ConnectionPeers', tested in core/tests/test_peer_scan.py)."""
    monkeypatch.setattr(peers, "MAX_PENDING_SCANS", 1)
    scanner = GatedScanner()
    processes = ConnectionProcesses(scan=scanner)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        processes.writer(pairs[0][0].fileno())
        assert scanner.scanned.wait(GATE_S)  # the worker holds it: the queue is empty
        processes.writer(pairs[1][0].fileno())
        given_up = processes.writer(pairs[2][0].fileno())
        assert given_up is not None and not given_up.armed.is_set()
        assert processes.take_failures() == {"mp_peer_scan_given_up": 1}
    finally:
        scanner.gate.set()
        processes.close()
        for pair in pairs:
            for end in pair:
                end.close()
