"""The reply to a LOOKUP given up on (one asking for no wait) may come after the client
released every lock it holds on the keys (``lookup_many`` gives back the keys of the
prompts answered before a timeout, which the prompts given up on share): the server read
that RELEASE after the LOOKUP, which it answered as it read it, so its locks went with it.
Releasing one lock per key again when the reply comes would drop a lock taken since --
a retrieve's, under views in use, whose extents could then change hands."""

from __future__ import annotations

import time

from native_keys import keys_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

CHUNK = 256


def test_a_late_lookup_reply_after_a_release_leaves_the_locks_taken_since(server: TiersServer) -> None:
    keys = keys_of(2)
    with Client(server.endpoint, timeout=30) as client:
        assert client.uses_shm
        assert client.store(keys, [bytes([index + 1]) * CHUNK for index in range(len(keys))]) == 2
        with client._lock:
            lookup = p.Lookup(0, "", keys)  # no wait: answered as the server reads it
            client._start(lookup, (), time.monotonic() + 30)
            client._give_up(lookup)  # as a timeout does
            frames = client._receive(30, False)  # its reply, handed to the client below
        assert frames is not None
        assert p.reply_decoder.decode(frames[0]).hits == 2
        assert client.release(keys) == 2  # what the lookup took, given back
        assert server.storage.l1.stats().read_locks == 0
        with client.retrieve(keys) as views:
            assert len(views) == 2
            assert server.storage.l1.stats().read_locks == 2
            with client._lock:
                client._early_or_settle(frames)  # the late reply is read only now
            client.ping()  # whatever its settling sent has been handled
            assert server.storage.l1.stats().read_locks == 2
        assert server.storage.l1.stats().read_locks == 0
