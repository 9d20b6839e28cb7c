"""Retrieve blocks of the same keys that overlap in one client -- on two threads sharing
it, or nested -- keep each other's leases: a block leaving releases only the keys no
other open block of the client reads, and the last one out releases the rest.  A block
used to release every lock the client held on its keys as it left, the other block's
too: that block's objects could then be cleared and their extents reused under its
views (wrong bytes while it read, StaleReadError at its end)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import until_reachable

SIZE = 256 << 10


def _stored(client: Client, count: int, fill: int) -> tuple[list[ObjectKey], list[bytes]]:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(count)]
    payloads = [np.full(SIZE, fill + index, dtype=np.uint8).tobytes() for index in range(count)]
    assert client.store(keys, payloads) == count
    return keys, payloads


def _locked_keys(client: Client) -> int:
    locked: int = client.status()["server"]["locked_keys"]
    return locked


def test_a_retrieve_block_on_another_thread_leaves_the_open_ones_locks(server: TiersServer) -> None:
    with Client(server.endpoint) as client, Client(server.endpoint) as other:
        keys, payloads = _stored(client, 4, 1)
        with client.retrieve(keys) as views:

            def read_the_same_keys() -> None:
                with client.retrieve(keys) as theirs:
                    assert [bytes(view) for view in theirs] == payloads

            thread = threading.Thread(target=read_the_same_keys)
            thread.start()
            thread.join()
            assert _locked_keys(client) == len(keys)
            # Locked objects are not cleared, so their extents cannot go to new objects.
            assert other.clear() == 0
            _stored(other, 4, 100)
            assert [bytes(view) for view in views] == payloads
        assert _locked_keys(client) == 0  # the last block out released the rest


def test_nested_retrieve_blocks_of_the_same_keys_keep_the_outer_ones_locks(server: TiersServer) -> None:
    with Client(server.endpoint) as client:
        keys, payloads = _stored(client, 3, 7)
        with client.retrieve(keys) as outer:
            with client.retrieve(keys[1:]):
                pass
            assert _locked_keys(client) == len(keys)
            assert [bytes(view) for view in outer] == payloads
        assert _locked_keys(client) == 0


def test_the_last_block_out_over_a_dropped_connection_releases_the_locks_of_the_next_one(
    make_server: Callable[..., TiersServer],
    restart_at_the_same_port: Callable[[TiersServer], TiersServer],
) -> None:
    """An outer block took its locks over a connection that dropped (the server restarted);
    an inner block of the same keys took its own over the next connection and left first,
    leaving them to the outer one.  The outer one, leaving last, releases them over that
    connection: they used to be left to the lock TTL, with the objects it pinned in L1."""
    first = make_server()
    client = Client(first.endpoint, timeout=5.0)
    try:
        keys, payloads = _stored(client, 3, 11)
        with client.retrieve(keys) as outer:
            assert [bytes(view) for view in outer] == payloads
            restart_at_the_same_port(first)
            until_reachable(client)
            fresh = [bytes([0xF0 + index]) * SIZE for index in range(len(keys))]
            assert client.store(keys, fresh) == len(keys)
            with client.retrieve(keys) as inner:
                assert [bytes(view) for view in inner] == fresh
            assert _locked_keys(client) == len(keys)  # the outer block reads the keys still
        assert _locked_keys(client) == 0
    finally:
        client.close()
