"""The fenced extents of clients whose exit the server cannot see ("unwatched") are bounded
together: past a quarter of L1, such clients' new STORE_RESERVEs are refused (a miss,
safe), counted and logged once per episode, until a commit or abort gives enough back.
Watched clients store on whatever others hold: their fences lift when their processes exit.

Each client alone is bounded at an eighth of L1; a stream of unwatched clients (a relay
coming back under new identities), each stalled under its own bound, would otherwise pin
all of L1, which eviction cannot free.  Clients here run in the test's process, which maps
the arena: watched through the kernel, or through their HELLO pid where the lookup of
their connection names no process.  One whose lookup names none and whose HELLO names no
process (pid 0, as a client of another pid namespace behind a relay may as well) cannot be
watched."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from native_keys import keys_of, stats_of
from native_stop import wait_for

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

#: a write TTL short enough for the server's own sweep and reap to expire a reservation
SHORT_TTL = {"l1_write_ttl_s": 1.0, "l1_lock_ttl_s": 1.0}
#: L1 is 64 MiB: each client's bound 8 MiB, all clients' 16 MiB; three stalled chunks of
#: 6 MiB each stay under their client's bound and reach the bound of all
CHUNK = 6 << 20
STALLED_CLIENTS = 3
STARTED = "new STORE_RESERVEs of such clients are refused"
ENDED = "new stores are accepted again"
#: the thread scanning for clients' processes, off the loop thread
SCAN_WORKER = "tiers-native-peer-scan"


def handlers_of(server: TiersServer) -> Any:
    frontend: Any = server.frontends[0]
    return frontend.handlers


def lookups_name_no_process(server: TiersServer) -> None:
    """Every connection's lookup ends naming no process: its client's HELLO pid stands in."""
    handlers_of(server).writers.scan = lambda peer: None


def unwatched(client: Client) -> Client:
    """``client`` says its process is pid 0: nothing here can watch it."""
    client._call(p.Hello(0, client._token, p.PROTOCOL_VERSION, "relay", 0), p.HelloReply)
    return client


def lookups_ended(server: TiersServer) -> None:
    """Wait until every connection's lookup has ended (a pending one counts as unwatched)."""
    connections = handlers_of(server).writers.connections
    wait_for(lambda: all(watch.armed.is_set() for _, watch in connections._of.values()), "every lookup ended")


def stall(server: TiersServer, writers: list[Client], keys: list[Any], *, lookups_end: bool = True) -> None:
    """Each writer reserves a chunk and never copies into nor commits it, alive: fenced
    once it expires, its lookups ended (unless not ``lookups_end``)."""
    handlers = handlers_of(server)
    for writer, key in zip(writers, keys, strict=True):
        reply = writer._call(p.StoreReserve(0, "", [key], [CHUNK]), p.StoreReserveReply)
        assert reply.slots[0].offset != p.NO_SLOT
    wait_for(
        lambda: sum(bool(session.fenced) for session in handlers.sessions) == len(writers),
        "every stalled reservation fenced with its client's",
    )
    if lookups_end:
        wait_for(
            lambda: all(
                writer is None or writer.armed.is_set()
                for session in handlers.sessions
                for writer in session.writers
            ),
            "every stalled writer's lookup ended",
        )
    each = [session.fenced_bytes for session in handlers.sessions if session.fenced]
    assert all(0 < held < handlers.fenced_bytes_per_client for held in each), each
    assert handlers.sessions.fenced.held >= handlers.sessions.fenced.bound


def gated_scans(server: TiersServer, stack: ExitStack) -> tuple[threading.Event, list[str]]:
    """Lookups that name no process (the HELLO pid stands in), run by the scan worker only
    while the returned event is set; and the names of the threads each ran on."""
    worker_may_scan = threading.Event()
    worker_may_scan.set()
    stack.callback(worker_may_scan.set)  # before the server stops: its close joins the worker
    scanned_on: list[str] = []

    def scan(peer: Any) -> None:
        scanned_on.append(threading.current_thread().name)
        if scanned_on[-1] == SCAN_WORKER:
            worker_may_scan.wait()
        return None

    handlers_of(server).writers.scan = scan
    return worker_may_scan, scanned_on


@pytest.fixture
def clients(make_server: Any) -> Iterator[tuple[TiersServer, ExitStack]]:
    with ExitStack() as stack:
        yield make_server(**SHORT_TTL), stack


def test_watched_clients_stalled_past_the_bound_refuse_no_other_clients_store(
    clients: tuple[TiersServer, ExitStack],
) -> None:
    # One hung engine's processes, alive and watched: their fences lift when they exit,
    # so the other engines store on in the rest of L1.
    server, stack = clients
    *stalled_keys, next_key = keys_of(STALLED_CLIENTS + 1)
    writers = [stack.enter_context(Client(server.endpoint)) for _ in range(STALLED_CLIENTS)]
    other = stack.enter_context(Client(server.endpoint))
    stall(server, writers, stalled_keys)
    handlers = handlers_of(server)
    assert not any(handlers.writers.unwatched(s.identity, s.writers) for s in handlers.sessions if s.fenced)

    assert other.store([next_key], [bytes(CHUNK)]) == 1
    assert stats_of(server).failures["store_refused_fenced"] == 0


def test_unwatched_clients_past_the_bound_refuse_only_unwatched_clients_stores_until_back_under(
    clients: tuple[TiersServer, ExitStack], caplog: pytest.LogCaptureFixture
) -> None:
    server, stack = clients
    lookups_name_no_process(server)
    caplog.set_level(logging.WARNING, logger="lmcache_plugin_frontend_native")
    *stalled_keys, next_key, watched_key, earlier_key = keys_of(STALLED_CLIENTS + 3)
    writers = [unwatched(stack.enter_context(Client(server.endpoint))) for _ in range(STALLED_CLIENTS)]
    relay = unwatched(stack.enter_context(Client(server.endpoint)))
    engine = stack.enter_context(Client(server.endpoint))
    assert engine.store([earlier_key], [b"earlier"]) == 1  # its connection looked up
    lookups_ended(server)
    stall(server, writers, stalled_keys)

    # Another client that cannot be watched is refused: its fences would pin L1 as well.
    for _ in range(2):
        with pytest.raises(ServerError) as refused:
            relay.store([next_key], [bytes(CHUNK)])
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
    stats = stats_of(server)
    assert stats.failures["store_refused_fenced"] == 2
    assert stats.store_keys_refused["out_of_memory"] == 2
    started = [r for r in caplog.records if STARTED in r.getMessage()]
    assert len(started) == 1, "an episode is logged once, not per refused store"

    # A watched client stores: its own fences would lift at its exit.
    assert engine.store([watched_key], [bytes(CHUNK)]) == 1
    assert stats_of(server).failures["store_refused_fenced"] == 2
    assert not [r for r in caplog.records if ENDED in r.getMessage()], "the episode goes on"

    # One stalled client says its copy ended: its fence lifts, stores go through.
    done = writers[0]._call(p.StoreCommit(0, "", [stalled_keys[0]]), p.StoreReply).done
    assert done == [False]  # its reservation was reaped: nothing stored
    assert relay.store([next_key], [bytes(CHUNK)]) == 1
    assert stats_of(server).failures["store_refused_fenced"] == 2
    ended = [r for r in caplog.records if ENDED in r.getMessage()]
    assert len(ended) == 1 and "2 were refused meanwhile" in ended[0].getMessage()


def test_one_client_stalled_past_its_bound_by_one_reservation_refuses_only_itself(make_server: Any) -> None:
    # Bounds are checked before reserving, so one reservation takes a client past its own
    # bound by its size, here past all clients' bound alone: the others still store.
    server = make_server(**SHORT_TTL)
    handlers = server.frontends[0].handlers
    large = 20 << 20
    assert large > handlers.sessions.fenced.bound > handlers.fenced_bytes_per_client
    stalled_key, next_key, own_key = keys_of(3)
    with Client(server.endpoint) as writer, Client(server.endpoint) as other:
        reply = writer._call(p.StoreReserve(0, "", [stalled_key], [large]), p.StoreReserveReply)
        assert reply.slots[0].offset != p.NO_SLOT
        wait_for(
            lambda: any(session.fenced for session in handlers.sessions), "the stalled reservation fenced"
        )

        assert other.store([next_key], [bytes(CHUNK)]) == 1
        with pytest.raises(ServerError) as refused:
            writer.store([own_key], [bytes(CHUNK)])  # past its own bound
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
        assert stats_of(server).failures["store_refused_fenced"] == 0


def test_unwatched_clients_whose_lookups_never_end_count_toward_the_bound(
    clients: tuple[TiersServer, ExitStack],
) -> None:
    # A lookup given up (more connections waiting for theirs than the scan queue holds)
    # stays pending for ever, and a pending lookup never says its process exited: those
    # clients' fences go only at their commit or abort, as an unwatched client's.  Here
    # the scan worker is held so that the stalled clients' lookups never end; a reconnect
    # storm of relay clients would leave theirs the same way, each under its own bound.
    server, stack = clients
    handlers = handlers_of(server)
    worker_may_scan, _ = gated_scans(server, stack)
    worker_may_scan.clear()  # the worker never arms a watch while the test runs
    *stalled_keys, next_key = keys_of(STALLED_CLIENTS + 1)
    writers = [unwatched(stack.enter_context(Client(server.endpoint))) for _ in range(STALLED_CLIENTS)]
    relay = unwatched(stack.enter_context(Client(server.endpoint)))
    stall(server, writers, stalled_keys, lookups_end=False)
    stalled = [session for session in handlers.sessions if session.fenced]
    assert all(not writer.armed.is_set() for session in stalled for writer in session.writers), "pending"

    with pytest.raises(ServerError) as refused:
        relay.store([next_key], [bytes(CHUNK)])
    assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
    assert stats_of(server).failures["store_refused_fenced"] == 1


def test_a_new_connection_while_unwatched_clients_reach_the_bound_is_never_scanned_on_the_loop(
    clients: tuple[TiersServer, ExitStack],
) -> None:
    # The episode may last until the server stops (unwatched clients gone at their
    # bounds): a lookup run on the loop thread at each new connection's first store would
    # hold every client's requests up for a /proc scan there, for good.  A store whose
    # lookup is still pending is refused instead (a miss), and stores once it has ended.
    server, stack = clients
    worker_may_scan, scanned_on = gated_scans(server, stack)
    *stalled_keys, watched_key = keys_of(STALLED_CLIENTS + 1)
    writers = [unwatched(stack.enter_context(Client(server.endpoint))) for _ in range(STALLED_CLIENTS)]
    stall(server, writers, stalled_keys)

    worker_may_scan.clear()
    engine = stack.enter_context(Client(server.endpoint))
    with pytest.raises(ServerError) as refused:
        engine.store([watched_key], [bytes(CHUNK)])
    assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
    worker_may_scan.set()
    lookups_ended(server)
    assert engine.store([watched_key], [bytes(CHUNK)]) == 1
    assert set(scanned_on) == {SCAN_WORKER}, scanned_on
