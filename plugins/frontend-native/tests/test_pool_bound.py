"""Pool requests sent faster than the pool ends them do not pile up on the server: while
the pool holds its bound of requests the native front end reads no more (they wait in
ZeroMQ's queues), answers what the pool ends, and then reads and answers the rest, in
the order they were sent."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from native_stop import STALL_LIMIT_S, dealer, wait_for

from lmcache_tiers import router as router_module
from lmcache_tiers.wire import protocol as p

#: requests per pool thread the front end holds here (one thread)
BOUND = 4
CLEARS = 3 * BOUND


def test_clears_past_the_pool_bound_wait_unread_then_are_answered_in_order(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(router_module, "POOL_REQUESTS_PER_WORKER", BOUND)
    server = make_server(frontends=[{"type": "native", "pool_workers": 1}])
    frontend = server.frontends[0]
    router = frontend.rpc.router
    go_on = threading.Event()
    clear = server.storage.clear

    def stalled(*, force: bool = False) -> int:
        go_on.wait(STALL_LIMIT_S)
        return clear(force=force)

    monkeypatch.setattr(server.storage, "clear", stalled)
    try:
        with dealer(server.endpoint) as sock:
            for req_id in range(1, CLEARS + 1):
                sock.send(p.encoder.encode(p.Clear(req_id, "")))
            wait_for(lambda: frontend.stats().pool_backpressure >= 1, "the loop holding its reading")
            assert router.in_pool == BOUND
            assert frontend.stats().requests["Clear"] == BOUND  # the rest are not read
            go_on.set()
            answered = [p.reply_decoder.decode(sock.recv()) for _ in range(CLEARS)]
    finally:
        go_on.set()
    assert [type(reply) for reply in answered] == [p.ClearReply] * CLEARS
    assert [reply.req_id for reply in answered] == list(range(1, CLEARS + 1))
    stats = frontend.stats()
    assert stats.requests["Clear"] == CLEARS
    assert stats.pool_backpressure >= 1
