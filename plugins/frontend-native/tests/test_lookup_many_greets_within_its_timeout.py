"""``lookup_many(..., timeout)`` is bounded by its ``timeout``, the greeting of a server
that may have restarted included.  After the connection dropped, the call greets the
server at the address before going by its key limit; that HELLO waited the client's
whole timeout for a server that is not back yet -- forever for a client made with an
infinite one -- where the lookups alone gave up at the call's own bound, so an engine
bounding its scheduler step by it stalled for as long as the server was down."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from native_keys import keys_of

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import greeting_bounds, stopped

Factory = Callable[..., TiersServer]

CALL_TIMEOUT_S = 0.2


def test_the_greeting_of_a_lookup_many_after_a_drop_is_bounded_by_its_timeout(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    with Client(server.endpoint, timeout=30) as client:
        stopped(server, client)
        bounds = greeting_bounds(client, monkeypatch)
        with pytest.raises(ClientError):  # nobody listens at the address
            client.lookup_many([keys_of(2)], timeout=CALL_TIMEOUT_S)
        assert bounds, "no greeting was sent"
        assert max(bounds) <= CALL_TIMEOUT_S
