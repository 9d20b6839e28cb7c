"""Keys and counters the native front end's tests share."""

from __future__ import annotations

import os

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugin import FrontendStats
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.frontend import store_keys_accounted


def keys_of(count: int) -> list[ObjectKey]:
    """``count`` keys of one request, in order, that no other call returns (a random
    prefix): a test's keys are never another test's, on a server they share."""
    prefix = os.urandom(8)
    return [ObjectKey("unit", 0, prefix + index.to_bytes(2, "big")) for index in range(count)]


def stats_of(server: TiersServer) -> FrontendStats:
    """The counters of the server's only front end."""
    ((_, stats),) = server.frontend_stats()
    return stats


def keys_accounted(server: TiersServer) -> int:
    """``store_keys_accounted`` of the native front end."""
    return store_keys_accounted(stats_of(server))


def leases_of(server: TiersServer) -> dict[str, int]:
    """L1's lease and quarantine counters (``/status``'s ``l1.leases``)."""
    return dict(server.storage_status()["l1"]["leases"])
