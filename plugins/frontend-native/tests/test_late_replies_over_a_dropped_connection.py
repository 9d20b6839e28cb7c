"""The reply to a request given up on may still be read after its connection dropped (it
was in the socket before the drop) and the socket connected again, to a server restarted
at the address.  What that request took lives in the session of the connection that
dropped: a RELEASE or STORE_ABORT of its keys over the new connection would give back
what this client took since over that one -- a lookup's lock, a store's reservation."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from native_keys import keys_of
from native_restarts import given_up_reply

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import restarted_at
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]

CHUNK = 64


@pytest.fixture
def restart(make_server: Factory) -> Iterator[tuple[Client, Callable[[], TiersServer]]]:
    """A client of a server, and what stops that server and starts another at its address
    once the client has seen its connection drop."""
    port = free_port()
    first = make_server(port=port)

    def restarted() -> TiersServer:
        return restarted_at(port, first, client, make_server)

    with Client(first.endpoint, timeout=30) as client:
        yield client, restarted


def test_a_late_lookup_reply_leaves_the_locks_taken_over_the_next_connection(
    restart: tuple[Client, Callable[[], TiersServer]],
) -> None:
    client, restarted = restart
    keys = keys_of(2)
    buffers = [bytes([index]) * CHUNK for index in range(len(keys))]
    client.store(keys, buffers)
    frames = given_up_reply(client, p.Lookup(0, "", keys))
    assert p.reply_decoder.decode(frames[0]).hits == 2  # it locked both keys
    second = restarted()
    client.store(keys, buffers)  # greets the restarted server
    assert client.lookup(keys) == 2  # a lock on each, over the new connection
    assert second.storage.l1.stats().read_locks == 2
    with client._lock:
        client._early_or_settle(frames)  # the old connection's reply is read only now
    client.ping()  # whatever its settling sent has been handled
    assert second.storage.l1.stats().read_locks == 2
    assert client.release(keys) == 2


def test_a_late_reservation_reply_leaves_the_reservations_of_the_next_connection(
    restart: tuple[Client, Callable[[], TiersServer]],
) -> None:
    client, restarted = restart
    keys = keys_of(2)
    frames = given_up_reply(client, p.StoreReserve(0, "", keys, [CHUNK] * len(keys)))
    reserved = p.reply_decoder.decode(frames[0])
    assert isinstance(reserved, p.StoreReserveReply)
    assert all(slot.offset != p.NO_SLOT for slot in reserved.slots)  # it reserved both keys
    restarted()
    client.ping()  # greets the restarted server
    client._follow_server()
    again = client._call(p.StoreReserve(0, "", keys, [CHUNK] * len(keys)), p.StoreReserveReply)
    assert all(slot.offset != p.NO_SLOT for slot in again.slots)
    with client._lock:
        client._early_or_settle(frames)  # the old connection's reply is read only now
    assert client._call(p.StoreCommit(0, "", keys), p.StoreReply).done == [True, True]
