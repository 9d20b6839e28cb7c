"""After the server restarted at the client's address, lookups, an evict and an
``l1_only`` store go by what the restarted server told in its HELLO, as stores and
retrieves do: they greet it first.  They went by the HELLO of the server before it until
a store or retrieve greeted the new one: a key limit lowered across the restart had the
server refuse them (TOO_LARGE), and a feature added across it had the client refuse them
itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from native_keys import keys_of, stats_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import restarted_at, until_the_drop_is_seen
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]

CHUNK = 4096
OLD_LIMIT = 4
NEW_LIMIT = 2


def _native(max_keys: int) -> list[dict[str, Any]]:
    return [{"type": "native", "max_keys_per_request": max_keys}]


def _buffers(count: int) -> list[np.ndarray[Any, Any]]:
    return [np.full(CHUNK, index + 1, dtype=np.uint8) for index in range(count)]


def _stored_by_another_client(server: TiersServer, keys: list[Any]) -> None:
    with Client(server.endpoint, timeout=30) as writer:
        assert writer.store(keys, _buffers(len(keys))) == len(keys)


@pytest.mark.parametrize("call", ["lookup", "lookup_many", "evict"])
def test_a_call_after_a_restart_with_a_lower_key_limit_goes_by_the_new_limit(
    make_server: Factory, call: str
) -> None:
    port = free_port()
    first = make_server(port=port, frontends=_native(OLD_LIMIT))
    keys = keys_of(OLD_LIMIT)
    with Client(first.endpoint, timeout=30) as client:
        assert client.max_keys == OLD_LIMIT
        second = restarted_at(port, first, client, make_server, frontends=_native(NEW_LIMIT))
        _stored_by_another_client(second, keys)
        if call == "lookup":
            assert client.lookup(keys) == len(keys)
            assert client.release(keys) == len(keys)
        elif call == "lookup_many":
            assert client.lookup_many([keys]) == [len(keys)]
            assert client.release(keys) == len(keys)
        else:
            assert client.evict(keys) == len(keys)
            assert second.storage.l1.stats().objects == 0
        assert client.max_keys == NEW_LIMIT
    assert stats_of(second).failures["too_large"] == 0


def test_a_lookup_whose_server_restarts_right_after_its_look_at_the_connection_is_sent_again(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restart comes between the lookup's look at the connection and its send: the
    request goes to the restarted server cut at the old limit, which refuses it; the
    client greets that server and looks the keys up again, cut at its limit."""
    port = free_port()
    first = make_server(port=port, frontends=_native(OLD_LIMIT))
    keys = keys_of(OLD_LIMIT)
    servers: list[TiersServer] = []
    with Client(first.endpoint, timeout=30) as client:
        look_up_part = client._lookup_part

        def restart_before_the_send(*args: Any) -> int:
            if not servers:
                servers.append(restarted_at(port, first, client, make_server, frontends=_native(NEW_LIMIT)))
                _stored_by_another_client(servers[0], keys)
            return look_up_part(*args)

        monkeypatch.setattr(client, "_lookup_part", restart_before_the_send)
        assert client.lookup(keys) == len(keys)
        assert client.max_keys == NEW_LIMIT
        assert client.release(keys) == len(keys)
    # The first request, cut at the old limit, was refused; nothing was taken for it.
    assert stats_of(servers[0]).failures["too_large"] == 1


@pytest.mark.parametrize("feature", ["l1_only_store", "evict"])
def test_a_call_after_a_restart_with_a_feature_added_uses_it(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, feature: str
) -> None:
    port = free_port()
    every_feature = p.FEATURES
    # The first server is an earlier release, without the feature, when the client greets it.
    monkeypatch.setattr(p, "FEATURES", tuple(name for name in every_feature if name != feature))
    first = make_server(port=port)
    keys = keys_of(2)
    with Client(first.endpoint, timeout=30) as client:
        assert feature not in client.server_features
        monkeypatch.setattr(p, "FEATURES", every_feature)
        first.request_stop()
        assert first.frontends[0].join(30)
        until_the_drop_is_seen(client)
        second = make_server(port=port)
        if feature == "l1_only_store":
            assert client.store(keys, _buffers(len(keys)), l1_only=True) == len(keys)
        else:
            _stored_by_another_client(second, keys)
            assert client.evict(keys) == len(keys)
        assert feature in client.server_features
