"""All clients' fenced extents together are bounded: past a quarter of L1, every new
STORE_RESERVE is refused (a miss, safe), counted and logged once per episode, until a
commit, abort or exit gives enough back.

Each client alone is bounded at an eighth of L1; without a bound over them all, clients
each under their own bound (stalled past the write TTL, or never coming back) would pin
all of L1, which eviction cannot free, and every store would fail."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from native_keys import keys_of, stats_of
from native_stop import wait_for

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.wire import protocol as p

#: a write TTL short enough for the server's own sweep and reap to expire a reservation
SHORT_TTL = {"l1_write_ttl_s": 1.0, "l1_lock_ttl_s": 1.0}
#: L1 is 64 MiB: each client's bound 8 MiB, all clients' 16 MiB; three stalled chunks of
#: 6 MiB each stay under their client's bound and reach the bound of all
CHUNK = 6 << 20
STALLED_CLIENTS = 3


def test_stores_are_refused_while_all_clients_fenced_bytes_reach_their_bound(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(**SHORT_TTL)
    handlers = server.frontends[0].handlers
    *stalled_keys, next_key = keys_of(STALLED_CLIENTS + 1)
    caplog.set_level(logging.WARNING, logger="lmcache_plugin_frontend_native")
    writers = [Client(server.endpoint) for _ in range(STALLED_CLIENTS)]
    try:
        with Client(server.endpoint) as other:
            for writer, key in zip(writers, stalled_keys, strict=True):
                # Reserved and never copied into nor committed: the writer stalled, alive.
                reply = writer._call(p.StoreReserve(0, "", [key], [CHUNK]), p.StoreReserveReply)
                assert reply.slots[0].offset != p.NO_SLOT
            wait_for(
                lambda: sum(bool(session.fenced) for session in handlers.sessions) == STALLED_CLIENTS,
                "every stalled reservation fenced with its client's",
            )
            each = [
                sum(obj.extent_bytes for obj in session.fenced.values())
                for session in handlers.sessions
                if session.fenced
            ]
            assert all(0 < held < handlers.fenced_bytes_per_client for held in each), each

            # A client holding no fence is refused as well: L1 is not there for it.
            for _ in range(2):
                with pytest.raises(ServerError) as refused:
                    other.store([next_key], [bytes(CHUNK)])
                assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
            stats = stats_of(server)
            assert stats.failures["store_refused_fenced"] == 2
            assert stats.store_keys_refused["out_of_memory"] == 2
            started = [r for r in caplog.records if "every new STORE_RESERVE is refused" in r.getMessage()]
            assert len(started) == 1, "an episode is logged once, not per refused store"

            # One stalled client says its copy ended: its fence lifts, stores go through.
            done = writers[0]._call(p.StoreCommit(0, "", [stalled_keys[0]]), p.StoreReply).done
            assert done == [False]  # its reservation was reaped: nothing stored
            assert other.store([next_key], [bytes(CHUNK)]) == 1
            assert stats_of(server).failures["store_refused_fenced"] == 2
            ended = [r for r in caplog.records if "new stores are accepted again" in r.getMessage()]
            assert len(ended) == 1 and "2 were refused meanwhile" in ended[0].getMessage()
    finally:
        for writer in writers:
            writer.close()


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
