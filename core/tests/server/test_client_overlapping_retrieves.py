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
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.client import Client, ProtocolError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import until_reachable
from lmcache_tiers.wire import protocol as p

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


def test_a_retrieve_that_fails_last_judges_its_locks_by_its_own_connection(
    make_server: Callable[..., TiersServer],
    restart_at_the_same_port: Callable[[TiersServer], TiersServer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block took its locks over a connection that dropped; a retrieve of the same keys
    took its own over the next connection, and failed after that block left.  Its locks
    are given back over that connection: they were judged by the block's older one
    (dropped since), left to the lock TTL, their objects pinned in L1."""
    first = make_server()
    client = Client(first.endpoint, timeout=5.0)
    try:
        keys, _ = _stored(client, 3, 21)
        outer = client.retrieve(keys)
        outer.__enter__()
        restart_at_the_same_port(first)
        until_reachable(client)
        assert client.store(keys, [bytes([0xE0 + index]) * SIZE for index in range(len(keys))]) == len(keys)
        call = client._call

        def locked_then_failed(request: Any, *args: Any, **kwargs: Any) -> Any:
            reply = call(request, *args, **kwargs)
            if isinstance(request, p.Retrieve):
                outer.__exit__(None, None, None)  # the older block leaves first
                raise ProtocolError("a reply this client cannot use")
            return reply

        monkeypatch.setattr(client, "_call", locked_then_failed)
        with pytest.raises(ProtocolError), client.retrieve(keys):
            pytest.fail("the failed retrieve handed out views")
        monkeypatch.undo()
        assert _locked_keys(client) == 0
    finally:
        client.close()
