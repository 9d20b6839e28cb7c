"""A lookup of more keys than a request takes goes part by part; when a server restarted
at the client's address with another key limit is greeted while it runs (by another call
of the client, a store), its parts still cover each key once.  They were cut at the
starts of the first limit and to the length of the new one: overlapping parts, each key
counted by each, and a hit count over the number of keys asked, which a caller takes as
that many keys cached."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from lmcache_tiers.client import Client
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import until_reachable


def _native(max_keys: int) -> list[dict[str, Any]]:
    return [{"type": "native", "max_keys_per_request": max_keys}]


def _restarted(make_server: Callable[..., TiersServer], first: TiersServer, max_keys: int) -> TiersServer:
    port = int(first.endpoint.rsplit(":", 1)[1])
    first.request_stop()
    deadline = time.monotonic() + 30
    while True:
        try:
            return make_server(port=port, frontends=_native(max_keys))
        except ConfigError:
            assert time.monotonic() < deadline, "the port of the stopped server never came free"
            time.sleep(0.1)  # the first one's port is still being given back


def test_a_lookup_in_parts_counts_each_key_once_when_the_key_limit_changes_under_it(
    make_server: Callable[..., TiersServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_server(frontends=_native(2))
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(6)]
    payloads = [bytes([index + 1]) * 4096 for index in range(len(keys))]
    with Client(first.endpoint, timeout=5.0) as client:
        assert client.store(keys, payloads) == len(keys)
        looked_up = client._lookup_part
        parts = 0

        def restart_after_the_first_part(*args: Any) -> int:
            nonlocal parts
            found = looked_up(*args)
            parts += 1
            if parts == 1:
                _restarted(make_server, first, 4)
                until_reachable(client)
                # Another call of the client greets the restarted server (and stores there).
                assert client.store(keys, payloads) == len(keys)
                assert client.max_keys == 4
            return found

        monkeypatch.setattr(client, "_lookup_part", restart_after_the_first_part)
        assert client.lookup(keys) == len(keys)
        monkeypatch.undo()
        client.release(keys)
