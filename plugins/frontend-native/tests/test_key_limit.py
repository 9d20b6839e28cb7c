"""The per-request key limit (``max_keys_per_request``): told in HELLO, honoured by the
client, and a request over it refused, counted and logged."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import zmq
from native_keys import keys_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]
LIMIT = 16


def exchange(endpoint: str, request: p._Request) -> p.Reply:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(p.encode(request))
        assert sock.poll(10_000), "no reply"
        return p.reply_decoder.decode(sock.recv_multipart()[0])
    finally:
        sock.close(0)
        context.term()


def test_a_request_over_the_key_limit_is_refused_and_one_at_it_served(
    make_server: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(frontends=[{"type": "native", "max_keys_per_request": LIMIT}])
    hello = exchange(server.endpoint, p.Hello(1, "", p.PROTOCOL_VERSION))
    assert isinstance(hello, p.HelloReply) and hello.max_keys == LIMIT
    with caplog.at_level(logging.WARNING, logger="lmcache_plugin_frontend_native"):
        for request in (
            p.Lookup(2, "", keys_of(LIMIT + 1)),
            p.Release(3, "", keys_of(LIMIT + 1)),
            p.StoreReserve(4, "", keys_of(LIMIT + 1), [64] * (LIMIT + 1)),
        ):
            refused = exchange(server.endpoint, request)
            assert isinstance(refused, p.ErrorReply)
            assert (refused.req_id, refused.code) == (request.req_id, p.ErrorCode.TOO_LARGE)
            assert f"limit of {LIMIT}" in refused.message
    assert server.frontends[0].stats().failures["too_large"] == 3
    assert server.storage.l1.stats().read_locks == 0  # nothing was taken for them
    refusals = [record.getMessage() for record in caplog.records if "refused request" in record.getMessage()]
    assert len(refusals) == 1 and f"limit of {LIMIT}" in refusals[0]  # once a minute per code
    served = exchange(server.endpoint, p.Lookup(5, "", keys_of(LIMIT)))
    assert isinstance(served, p.LookupReply) and served.hits == 0


def test_the_client_splits_its_batches_at_the_limit_the_server_told(make_server: Factory) -> None:
    server = make_server(frontends=[{"type": "native", "max_keys_per_request": LIMIT}])
    keys = keys_of(3 * LIMIT + 5)
    with Client(server.endpoint) as client:
        assert client.max_keys == LIMIT
        assert client.store(keys, [b"v" * 64] * len(keys)) == len(keys)
        assert client.lookup(keys) == len(keys)
        assert client.release(keys) == len(keys)
    assert server.frontends[0].stats().failures["too_large"] == 0
