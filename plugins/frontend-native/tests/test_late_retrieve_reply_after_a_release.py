"""The reply to a RETRIEVE given up on may come after the client released every lock it
holds on the keys (a timed-out retrieve gives its keys back at once): the server read that
RELEASE after the RETRIEVE, so its locks went with it.  Releasing one lock per key again
when the reply comes would drop a lock taken since -- another retrieve's, under views in
use, whose extents could then change hands."""

from __future__ import annotations

import time

from native_keys import keys_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

CHUNK = 256


def test_a_late_retrieve_reply_after_a_release_leaves_the_locks_taken_since(server: TiersServer) -> None:
    keys = keys_of(2)
    with Client(server.endpoint, timeout=30) as client:
        assert client.uses_shm
        assert client.store(keys, [bytes([index + 1]) * CHUNK for index in range(len(keys))]) == 2
        with client._lock:
            retrieve = p.Retrieve(0, "", keys)
            client._start(retrieve, (), time.monotonic() + 30)
            client._give_up(retrieve)  # as a timeout does
            frames = client._receive(30, False)  # its reply, handed to the client below
        assert frames is not None
        assert len(p.reply_decoder.decode(frames[0]).slots) == 2
        assert client.release(keys) == 2  # what the retrieve took, given back
        assert server.storage.l1.stats().read_locks == 0
        with client.retrieve(keys) as views:
            assert len(views) == 2
            assert server.storage.l1.stats().read_locks == 2
            with client._lock:
                client._early_or_settle(frames)  # the late reply is read only now
            client.ping()  # whatever its settling sent has been handled
            assert server.storage.l1.stats().read_locks == 2
        assert server.storage.l1.stats().read_locks == 0
