"""The ``default`` prefetch policy."""

from __future__ import annotations

from lmcache_plugin_prefetch_default import DefaultPrefetchConfig
from lmcache_tiers.plugin import LowestIndexPrefetchPolicy


class DefaultPrefetchPolicy(LowestIndexPrefetchPolicy):
    """Lowest-index adapter that has the key; loaded objects are temporary in L1."""

    retain_loaded = False

    def __init__(self, config: DefaultPrefetchConfig | None = None) -> None:
        self.config = config or DefaultPrefetchConfig()
