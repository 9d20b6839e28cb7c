"""Keys and counters the native front end's tests share."""

from __future__ import annotations

import os

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugin import FrontendStats
from lmcache_tiers.server.app import TiersServer


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
    """The store keys the native front end accounts for: stored, skipped and refused.
    Every key a store names is one of these, once, however its request ended."""
    stats = stats_of(server)
    return (
        stats.store_chunks + sum(stats.store_keys_skipped.values()) + sum(stats.store_keys_refused.values())
    )


def leases_of(server: TiersServer) -> dict[str, int]:
    """L1's lease and quarantine counters (``/status``'s ``l1.leases``)."""
    return dict(server.storage_status()["l1"]["leases"])
