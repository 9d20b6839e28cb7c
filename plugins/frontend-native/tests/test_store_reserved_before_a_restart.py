"""A shared-memory store whose reservation was answered by a server that restarted before
the store could look at it: another thread of the client has greeted the restarted server
since, and reserved the same keys there (its copy still to come).  The store's
reservations went with the old server; its abort must not reach the restarted one, where
it named the other thread's reservations by key and freed their extents under their copy
-- bytes then written into whatever object the server put there next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from native_fence_support import CuttableLink
from native_keys import keys_of
from native_restarts import (
    assert_stored_there,
    copied_and_committed_by_that_thread,
    reserved_by_another_thread,
)
from native_stop import wait_for

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import restarted_at
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]

CHUNK = 4096


def test_a_store_answered_by_a_server_gone_since_aborts_nothing_on_the_restarted_one(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    first = make_server(port=port)
    keys = keys_of(2)
    buffers = [np.full(CHUNK, index + 1, dtype=np.uint8) for index in range(len(keys))]
    with Client(first.endpoint, timeout=30) as client:
        looked_at = client._answered_elsewhere
        theirs: list[list[p.Slot]] = []

        def restart_before_the_look(segment: Any) -> bool:
            """Between the store's reservation and its look at the server, the server
            restarts, and another thread of the client greets it and reserves the same
            keys there."""
            if not theirs:
                restarted_at(port, first, client, make_server)
                theirs.append(reserved_by_another_thread(client, keys, CHUNK))
            return looked_at(segment)

        monkeypatch.setattr(client, "_answered_elsewhere", restart_before_the_look)
        # Tried again on the restarted server, the keys are the other thread's to store.
        assert client.store(keys, buffers) == 0
        monkeypatch.undo()
        # The other thread's reservations are still its own: it copies and commits them.
        copied_and_committed_by_that_thread(client, theirs[0], keys, buffers)


def test_a_store_answered_by_the_restarted_server_aborts_there_and_stores_again(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its reservation went to the restarted server over the connection still up, before
    anything greeted it: the abort goes there, and the store's second try stores them."""
    port = free_port()
    first = make_server(port=port)
    keys = keys_of(2)
    buffers = [np.full(CHUNK, index + 1, dtype=np.uint8) for index in range(len(keys))]
    with Client(first.endpoint, timeout=30) as client:
        store_batch = client._store_shm
        looked_at = client._answered_elsewhere
        restarted: list[TiersServer] = []

        def restart_before_the_reservation(*args: Any) -> int:
            if not restarted:
                restarted.append(restarted_at(port, first, client, make_server))
            return store_batch(*args)

        def greeted_before_the_look(segment: Any) -> bool:
            client._follow_server()  # another thread of the client
            return looked_at(segment)

        monkeypatch.setattr(client, "_store_shm", restart_before_the_reservation)
        monkeypatch.setattr(client, "_answered_elsewhere", greeted_before_the_look)
        assert client.store(keys, buffers) == len(keys)
        monkeypatch.undo()
        assert_stored_there(restarted[0].endpoint, keys, buffers)


def test_a_store_whose_connection_dropped_before_the_look_aborts_by_its_process_and_stores_again(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same server, over another connection: the abort reaches the reservations made
    over the one that dropped (its process named in HELLO), and the second try stores
    them rather than finding them still being written."""
    keys = keys_of(2)
    buffers = [np.full(CHUNK, index + 1, dtype=np.uint8) for index in range(len(keys))]
    link = CuttableLink(server.endpoint)
    try:
        with Client(link.url, timeout=30) as client:
            looked_at = client._answered_elsewhere
            cut: list[bool] = []

            def back() -> bool:
                with client._lock:
                    client._read_link_events()
                    return client._dropped and not client._unlinked

            def drop_before_the_look(segment: Any) -> bool:
                if not cut:
                    cut.append(True)
                    link.cut()
                    wait_for(back, "the client dropped and connected again")
                return looked_at(segment)

            monkeypatch.setattr(client, "_answered_elsewhere", drop_before_the_look)
            assert client.store(keys, buffers) == len(keys)
            monkeypatch.undo()
        assert_stored_there(server.endpoint, keys, buffers)
    finally:
        link.close()
