"""``lookup_many(..., timeout)`` is bounded by its ``timeout``, the greeting of a server
that may have restarted included.  After the connection dropped, the call greets the
server at the address before going by its key limit; that HELLO waited the client's
whole timeout for a server that is not back yet -- forever for a client made with an
infinite one -- where the lookups alone gave up at the call's own bound, so an engine
bounding its scheduler step by it stalled for as long as the server was down."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from native_keys import keys_of

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import until_the_drop_is_seen
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]

CALL_TIMEOUT_S = 0.2


def test_the_greeting_of_a_lookup_many_after_a_drop_is_bounded_by_its_timeout(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    with Client(server.endpoint, timeout=30) as client:
        server.request_stop()
        assert server.frontends[0].join(30)
        until_the_drop_is_seen(client)
        bounds: list[float] = []
        round_trip = client._round_trip

        def noting_the_bound(request: p._Request, expect: Any, seconds: float) -> Any:
            if isinstance(request, p.Hello):
                bounds.append(seconds)
            return round_trip(request, expect, seconds)

        monkeypatch.setattr(client, "_round_trip", noting_the_bound)
        with pytest.raises(ClientError):  # nobody listens at the address
            client.lookup_many([keys_of(2)], timeout=CALL_TIMEOUT_S)
        assert bounds, "no greeting was sent"
        assert max(bounds) <= CALL_TIMEOUT_S
