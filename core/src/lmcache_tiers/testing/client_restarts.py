"""A server stopped and another started at its address while a client stays, and the bounds
the client gives its greetings, for the tests of a client across drops and restarts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from lmcache_tiers.client import Client
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p


def until_the_drop_is_seen(client: Client) -> None:
    """Wait until ``client`` has read its connection's drop from the connection events."""
    deadline = time.monotonic() + 30
    while True:
        with client._lock:
            client._read_link_events()
            if client._unlinked:
                return
        assert time.monotonic() < deadline, "the client never saw its connection drop"
        time.sleep(0.01)


def stopped(server: TiersServer, client: Client) -> None:
    """Stop ``server``; return once ``client`` has seen its connection drop."""
    server.request_stop()
    assert server.frontends[0].join(30)
    until_the_drop_is_seen(client)


def greeting_bounds(client: Client, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The bounds, in seconds, ``client`` gives the HELLOs it sends from now on (until
    ``monkeypatch`` is undone), in the order it sends them."""
    bounds: list[float] = []
    round_trip = client._round_trip

    def noting_the_bound(request: p._Request, expect: Any, seconds: float) -> Any:
        if isinstance(request, p.Hello):
            bounds.append(seconds)
        return round_trip(request, expect, seconds)

    monkeypatch.setattr(client, "_round_trip", noting_the_bound)
    return bounds


def restarted_at(
    port: int, first: TiersServer, client: Client, make_server: Callable[..., TiersServer], **config: Any
) -> TiersServer:
    """Stop ``first`` and start another server at ``port``, its address (made with
    ``config``), once ``client`` has seen its connection drop."""
    stopped(first, client)
    deadline = time.monotonic() + 30
    while True:
        try:
            return make_server(port=port, **config)
        except ConfigError:
            assert time.monotonic() < deadline, "the port of the stopped server never came free"
            time.sleep(0.1)  # the first one's port is still being given back
