"""A request sent right after the client's socket reconnected to a server restarted at its
address goes over the new connection: however slow its reply, it is waited for, not failed
as lost with the connection that dropped before it was sent."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
import zmq
from native_keys import keys_of

from lmcache_tiers.client import Client, connection
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import until_the_drop_is_seen
from lmcache_tiers.testing.ports import free_port

Factory = Callable[..., TiersServer]

#: how long the restarted server's L2 takes to answer a lookup: several of the client's
#: looks at its connection while a request waits for its reply
SLOW_LOOKUP_S = 4 * connection.LINK_CHECK_S


def _slow_l2() -> list[str]:
    inner = {"type": "mock", "max_size_gb": 0.1}
    spec = {"type": "fault_inject", "inner": inner, "delay_s": SLOW_LOOKUP_S, "delay_ops": ["lookup"]}
    return [json.dumps(spec)]


@pytest.fixture
def reconnected(make_server: Factory) -> Iterator[Client]:
    """A client whose server restarted at its address: the client has seen the first
    connection drop, and its socket has connected to the restarted server (whose L2 is
    slow) since, which the client has not looked at yet."""
    port = free_port()
    first = make_server(port=port)
    with Client(first.endpoint, timeout=30) as client:
        first.request_stop()
        assert first.frontends[0].join(30)
        until_the_drop_is_seen(client)
        make_server(adapters=_slow_l2(), port=port)
        # Asked of the sockets themselves: the connection events stay unread.
        assert client._socket.poll(30_000, zmq.POLLOUT), "the socket never reconnected"
        assert client._monitor is not None
        assert client._monitor.poll(30_000, zmq.POLLIN), "the new connection was never reported"
        yield client


def test_a_request_sent_soon_after_a_look_that_found_no_connection_is_waited_for(
    reconnected: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last look at the connection found none, and the socket reconnected within the
    time a look that found one is trusted for."""
    monkeypatch.setattr(connection, "_EVENTS_FRESH_S", 3600.0)  # every look is recent
    handle, hits = reconnected.start_lookup(keys_of(2))  # the slow L2 is asked
    assert hits is None
    assert reconnected.wait_prefetch(handle, 30) == 0


def test_a_request_sent_before_its_new_connection_is_reported_is_waited_for(
    reconnected: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libzmq hands the socket a new connection a moment before it reports it: the look
    right before the send misses the report."""
    read = reconnected._read_link_events
    missed: list[bool] = []

    def read_all_but_the_first() -> None:
        if not missed:
            missed.append(True)
            return
        read()

    monkeypatch.setattr(reconnected, "_read_link_events", read_all_but_the_first)
    assert reconnected.lookup(keys_of(2)) == 0  # one request: the server waits for its slow L2
    assert missed
