"""Inline stores sent faster than the pool copies them do not pile up their bytes on the
server: while the messages of the requests on the pool add up to ``frontend_pool_max_mb``
the native front end reads no more (they wait in ZeroMQ's queues), however far under its
request bound it is, then reads and answers the rest in the order they were sent.  A
bound under the largest request the front end takes is refused at start-up."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from lmcache_plugin_frontend_native import NativeConfig
from native_keys import keys_of
from native_stop import STALL_LIMIT_S, dealer, wait_for

from lmcache_tiers.config import ServerConfig
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.wire import protocol as p

#: the byte bound (frontend_pool_max_mb) in MiB
BOUND_MB = 1
#: each store's payload: four of them reach the bound (with their headers), three do not
PAYLOAD = 256 << 10
AT_BOUND = 4
STORES = 3 * AT_BOUND


def test_inline_stores_past_the_byte_bound_wait_unread_then_are_answered_in_order(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(
        frontends=[
            {"type": "native", "pool_workers": 1, "max_request_bytes": PAYLOAD, "max_inline_bytes": PAYLOAD}
        ],
        frontend_pool_max_mb=BOUND_MB,
    )
    frontend = server.frontends[0]
    router = frontend.rpc.router
    assert router.max_pool_requests > STORES  # only the byte bound can hold the loop here
    go_on = threading.Event()
    reserve_write = server.storage.reserve_write

    def stalled(*args: Any, **kwargs: Any) -> Any:
        go_on.wait(STALL_LIMIT_S)
        return reserve_write(*args, **kwargs)

    monkeypatch.setattr(server.storage, "reserve_write", stalled)
    headers = [p.encoder.encode(p.StoreInline(req_id, "", keys_of(1))) for req_id in range(1, STORES + 1)]
    try:
        with dealer(server.endpoint) as sock:
            for header in headers:
                sock.send_multipart([header, b"x" * PAYLOAD])
            wait_for(lambda: frontend.stats().pool_backpressure >= 1, "the loop holding its reading")
            assert frontend.stats().requests["StoreInline"] == AT_BOUND  # the rest are not read
            assert router.in_pool == AT_BOUND
            assert router.pool_bytes == sum(len(header) + PAYLOAD for header in headers[:AT_BOUND])
            assert frontend.stats().pool_backpressure_bytes == 1
            go_on.set()
            answered = [p.reply_decoder.decode(sock.recv()) for _ in range(STORES)]
    finally:
        go_on.set()
    assert [type(reply) for reply in answered] == [p.StoreReply] * STORES
    assert [reply.req_id for reply in answered] == list(range(1, STORES + 1))
    assert all(reply.done == [True] for reply in answered)
    stats = frontend.stats()
    assert stats.requests["StoreInline"] == STORES
    assert stats.pool_backpressure_bytes >= 1
    wait_for(lambda: router.pool_bytes == 0, "the pool's bytes given back")


def test_a_byte_bound_under_the_largest_request_is_refused() -> None:
    native = NativeConfig(max_request_bytes=3 << 20, max_inline_bytes=1 << 20)
    with pytest.raises(ConfigError, match="frontend_pool_max_mb") as refused:
        native.check(ServerConfig(frontend_pool_max_mb=2), None)
    assert "\n" not in str(refused.value)
    native.check(ServerConfig(frontend_pool_max_mb=3), None)  # one largest request fits
    NativeConfig().check(ServerConfig(), None)  # the defaults agree
