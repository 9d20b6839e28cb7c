"""``store(l1_only=True)`` raises ClientError when the server cannot keep the objects out
of L2.  What the server can do is asked of the server the store goes to: one restarted at
the address as an earlier release (no feature ``l1_only_store``) ignores the flag, and
would copy the objects to L2 as any others."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from native_keys import keys_of

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.testing.server import until_reachable
from lmcache_tiers.wire import protocol as p


def test_an_l1_only_store_to_a_server_restarted_without_the_feature_is_refused(
    make_server: Callable[..., TiersServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    first = make_server(port=port)
    keys = keys_of(2)
    with Client(first.endpoint, timeout=30) as client:
        assert "l1_only_store" in client.server_features
        first.request_stop()
        assert first.frontends[0].join(30)
        deadline = time.monotonic() + 30
        while not client._connection_dropped():
            assert time.monotonic() < deadline, "the client never saw its connection drop"
            time.sleep(0.01)
        # The restarted server announces what an earlier release did.
        earlier = tuple(feature for feature in p.FEATURES if feature != "l1_only_store")
        monkeypatch.setattr(p, "FEATURES", earlier)
        second = make_server(port=port)
        until_reachable(client)
        with pytest.raises(ClientError, match="L2"):
            client.store(keys, [np.ones(256, dtype=np.uint8)] * len(keys), l1_only=True)
        assert "l1_only_store" not in client.server_features
        assert second.storage.l1.stats().objects == 0
