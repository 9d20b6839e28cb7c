"""``lookup(..., timeout)`` is bounded by its ``timeout``, the greeting of a server that
may have restarted included.  After the connection dropped, the call greets the server at
the address before going by its key limit; that HELLO waited the client's whole timeout
for a server not back yet, where the lookup itself (against a server without
``lookup_wait``) gave up at the call's own bound."""

from __future__ import annotations

import pytest
from client_restarts import Factory, fresh_keys

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.testing.client_restarts import greeting_bounds, stopped
from lmcache_tiers.wire import protocol as p

CLIENT_TIMEOUT_S = 3.0
CALL_TIMEOUT_S = 0.2


@pytest.mark.parametrize("lookup_wait", [False, True])
def test_the_greeting_of_a_lookup_after_a_drop_is_bounded_by_its_timeout(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, lookup_wait: bool
) -> None:
    if not lookup_wait:  # an earlier release's server
        monkeypatch.setattr(p, "FEATURES", tuple(name for name in p.FEATURES if name != "lookup_wait"))
    server = make_server()
    with Client(server.endpoint, timeout=CLIENT_TIMEOUT_S) as client:
        assert ("lookup_wait" in client.server_features) is lookup_wait
        stopped(server, client)
        bounds = greeting_bounds(client, monkeypatch)
        with pytest.raises(ClientError):  # nobody listens at the address
            client.lookup(fresh_keys(2), timeout=CALL_TIMEOUT_S)
        assert bounds, "no greeting was sent"
        assert max(bounds) <= CALL_TIMEOUT_S
