"""The LMCache front end's counters, as its tests read them."""

from __future__ import annotations

from lmcache_tiers.plugin import FrontendStats
from lmcache_tiers.server.app import TiersServer


def mp_stats(server: TiersServer) -> FrontendStats:
    """The counters of the server's LMCache front end (``make_mp_server`` builds it first)."""
    stats: FrontendStats = server.frontends[0].stats()
    return stats


def keys_accounted(server: TiersServer) -> int:
    """The store keys the LMCache front end accounts for: stored, skipped and refused.
    Every key a store names is one of these, once, however its request ended."""
    stats = mp_stats(server)
    return (
        stats.store_chunks + sum(stats.store_keys_skipped.values()) + sum(stats.store_keys_refused.values())
    )
