"""The reply to a LOOKUP (one asking for no wait) or a RETRIEVE given up on may come after
the client released every lock it holds on the keys (a timed-out retrieve gives its keys
back at once; ``lookup_many`` gives back the keys of the prompts answered before a timeout,
which the prompts given up on share): the server read that RELEASE after the request, which
it answered as it read it, so the request's locks went with it.  Releasing one lock per key
again when the reply comes would drop a lock taken since -- a retrieve's, under views in
use, whose extents could then change hands."""

from __future__ import annotations

import pytest
from native_keys import keys_of
from native_restarts import given_up_reply

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

CHUNK = 256


@pytest.mark.parametrize("kind", [p.Lookup, p.Retrieve], ids=["lookup", "retrieve"])
def test_a_late_reply_after_a_release_leaves_the_locks_taken_since(
    server: TiersServer, kind: type[p.Lookup] | type[p.Retrieve]
) -> None:
    keys = keys_of(2)
    with Client(server.endpoint, timeout=30) as client:
        assert client.uses_shm
        assert client.store(keys, [bytes([index + 1]) * CHUNK for index in range(len(keys))]) == 2
        frames = given_up_reply(client, kind(0, "", keys))  # a LOOKUP with no wait: answered at once
        reply = p.reply_decoder.decode(frames[0])
        assert (reply.hits if kind is p.Lookup else len(reply.slots)) == 2
        assert client.release(keys) == 2  # what the request took, given back
        assert server.storage.l1.stats().read_locks == 0
        with client.retrieve(keys) as views:
            assert len(views) == 2
            assert server.storage.l1.stats().read_locks == 2
            with client._lock:
                client._early_or_settle(frames)  # the late reply is read only now
            client.ping()  # whatever its settling sent has been handled
            assert server.storage.l1.stats().read_locks == 2
        assert server.storage.l1.stats().read_locks == 0
