"""Servers restarted at a client's address, for the client's tests: the first one stopped,
the client having seen its connection drop, another one started at the same port (with a
key limit of its own, when given)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lmcache_tiers.client import Client
from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import restarted_at

Factory = Callable[..., TiersServer]


def native(max_keys: int) -> list[dict[str, Any]]:
    """The native front end, taking at most ``max_keys`` keys per request."""
    return [{"type": "native", "max_keys_per_request": max_keys}]


def fresh_keys(count: int) -> list[ObjectKey]:
    """``count`` keys no other test uses."""
    prefix = os.urandom(8)
    return [ObjectKey("unit", 0, prefix + index.to_bytes(2, "big")) for index in range(count)]


def payloads(count: int) -> list[bytes]:
    return [bytes([index + 1]) * 4096 for index in range(count)]


def stats_of(server: TiersServer) -> FrontendStats:
    """The counters of the server's only front end."""
    ((_, stats),) = server.frontend_stats()
    return stats


def stored_by_another_client(server: TiersServer, keys: list[ObjectKey]) -> None:
    with Client(server.endpoint, timeout=30) as writer:
        assert writer.store(keys, payloads(len(keys))) == len(keys)


def restarted(
    make_server: Factory, first: TiersServer, client: Client, max_keys: int | None = None
) -> TiersServer:
    """Stop ``first`` and start another server at its port (taking ``max_keys`` keys per
    request, when given), once ``client`` has seen its connection drop."""
    port = int(first.endpoint.rsplit(":", 1)[1])
    config: dict[str, Any] = {} if max_keys is None else {"frontends": native(max_keys)}
    return restarted_at(port, first, client, make_server, **config)
