"""The LMCache front end's counters, as its tests read them."""

from __future__ import annotations

from lmcache_tiers.plugin import FrontendStats
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.frontend import store_keys_accounted


def mp_stats(server: TiersServer) -> FrontendStats:
    """The counters of the server's LMCache front end (``make_mp_server`` builds it first)."""
    stats: FrontendStats = server.frontends[0].stats()
    return stats


def keys_accounted(server: TiersServer) -> int:
    """``store_keys_accounted`` of the LMCache front end."""
    return store_keys_accounted(mp_stats(server))
