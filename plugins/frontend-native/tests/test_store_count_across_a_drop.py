"""A shared-memory store of several batches whose connection drops between two of them
counts every key it stored.  The batch after the drop finds its reply may come from
another server and the store goes again, on the same server once it has said HELLO: the
batches committed before the drop are there, and used to be reserved again, skipped as
present and left out of the count -- a store of every key returned fewer."""

from __future__ import annotations

from typing import Any

import pytest
from native_fence_support import CHUNK, CuttableLink, read
from native_keys import keys_of
from native_stop import wait_for

from lmcache_tiers.client import Client

LIMIT = 2


def test_a_store_whose_connection_drops_between_batches_counts_every_key_stored(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(frontends=[{"type": "native", "max_keys_per_request": LIMIT}])
    keys = keys_of(2 * LIMIT)
    payloads = [bytes([index + 1]) * CHUNK for index in range(len(keys))]
    link = CuttableLink(server.endpoint)
    try:
        with Client(link.url) as writer, Client(server.endpoint) as reader:
            store_batch = writer._store_shm
            batches = 0

            def back() -> bool:
                with writer._lock:
                    writer._read_link_events()
                    return writer._dropped and not writer._unlinked

            def cut_before_the_second_batch(*args: Any) -> int:
                nonlocal batches
                batches += 1
                if batches == 2:
                    link.cut()
                    wait_for(back, "the client dropped and connected again")
                return store_batch(*args)

            monkeypatch.setattr(writer, "_store_shm", cut_before_the_second_batch)
            assert writer.store(keys, payloads) == len(keys)
            monkeypatch.undo()
            assert [read(reader, key) for key in keys] == payloads
    finally:
        link.close()
