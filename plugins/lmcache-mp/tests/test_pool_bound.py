"""Pickled stores streamed faster than the pool copies them do not pile up on the server:
while the pool holds its bound of requests the front end reads no more (the client's
requests wait in ZeroMQ's queues), and every store is still answered and stored once
the pool has room."""

from __future__ import annotations

from typing import Any

import pytest
from mpclient import (
    MPClient,
    Registration,
    mp_address,
    send_pickled_store,
    stalled_fills,
    wait_for,
)

from lmcache_tiers import router as router_module

REG = Registration()
#: requests per pool thread the front end holds here (one thread)
BOUND = 4
STORES = 3 * BOUND
CHUNKS = 4


def test_pickled_stores_past_the_pool_bound_wait_unread_then_are_all_stored(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(router_module, "POOL_REQUESTS_PER_WORKER", BOUND)
    server = make_mp_server(shm=False, allow_pickle=True, workers=1)
    storage, frontend = server.storage, server.frontends[0]
    router = frontend.loop.router
    with stalled_fills(storage, monkeypatch) as go_on, MPClient(mp_address(server)) as client:
        client.register(REG)
        uids = [
            send_pickled_store(client, 100 + sequence, f"stream-{sequence}", CHUNKS)
            for sequence in range(STORES)
        ]
        wait_for(lambda: frontend.stats().pool_backpressure >= 1, "the loop holding its reading")
        assert router.in_pool == BOUND
        assert frontend.stats().requests["commit_store"] == BOUND  # the rest are not read
        go_on.set()
        for uid in uids:
            assert client.no_reply_to(uid, wait_ms=30_000) is False
    stats = frontend.stats()
    assert stats.requests["commit_store"] == STORES
    assert stats.store_chunks == STORES * CHUNKS
    assert stats.pool_backpressure >= 1
