"""A connection that sends inline RETRIEVEs without reading its replies is refused more
once its unsent replies reach their bound, instead of the server queueing a copy of every
reply (up to the largest inline reply each) until it runs out of memory; other clients
are served their own bytes meanwhile."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import zmq
from native_keys import keys_of, stats_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]
INLINE_LIMIT = 64 << 10
REQUESTS = 3000


def test_a_client_not_reading_its_inline_replies_is_refused_past_its_bound(make_server: Factory) -> None:
    server = make_server(frontends=[{"type": "native", "max_inline_bytes": INLINE_LIMIT}])
    keys, small = keys_of(1), keys_of(1)
    data, small_data = [os.urandom(INLINE_LIMIT)], [os.urandom(1024)]
    context = zmq.Context()
    greedy = context.socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.RCVHWM, 1)  # its replies back up into the server's queue
    greedy.setsockopt(zmq.RCVBUF, 4096)
    try:
        with Client(server.endpoint, shm=False) as reader:
            assert reader.store(keys, data) == 1
            assert reader.store(small, small_data) == 1
            greedy.connect(server.endpoint)
            for req_id in range(1, REQUESTS + 1):
                greedy.send(p.encode(p.Retrieve(req_id, "", keys, inline=True)))
            stats = stats_of(server)
            deadline = time.monotonic() + 60
            read = 0
            while stats.requests["Retrieve"] - read < REQUESTS and time.monotonic() < deadline:
                # Served, and its own bytes, throughout: small replies, so that the moment
                # the server takes to let go of each sent one never adds up to the bound.
                with reader.retrieve(small) as views:
                    assert [bytes(view) for view in views] == small_data
                read += 1
            assert stats.requests["Retrieve"] - read >= REQUESTS, "the server did not get to the requests"
            refused = stats.failures["out_of_memory"]
            # Each accepted request queued a reply the client does not read: at most the
            # bound's worth beyond what the kernel's socket buffers took.
            assert refused > 0
            assert REQUESTS - refused < REQUESTS // 2
    finally:
        greedy.close(0)
        context.term()
