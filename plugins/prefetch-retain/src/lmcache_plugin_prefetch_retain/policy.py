"""The ``retain`` prefetch policy."""

from __future__ import annotations

from lmcache_plugin_prefetch_retain import RetainPrefetchConfig
from lmcache_tiers.plugin import LowestIndexPrefetchPolicy


class RetainPrefetchPolicy(LowestIndexPrefetchPolicy):
    """Same plan as ``default``, but loaded objects become ordinary L1 objects.

    They stay after the reader releases them and are subject to L1 eviction like any
    written object, so a repeated prefix hits L1 without another L2 load.
    """

    retain_loaded = True

    def __init__(self, config: RetainPrefetchConfig | None = None) -> None:
        self.config = config or RetainPrefetchConfig()
