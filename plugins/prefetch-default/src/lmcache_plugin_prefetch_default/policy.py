"""The ``default`` prefetch policy."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_plugin_prefetch_default import DefaultPrefetchConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.policies import AdapterInfo, plan_from_lowest_index


class DefaultPrefetchPolicy:
    """Lowest-index adapter that has the key; loaded objects are temporary in L1."""

    retain_loaded = False

    def __init__(self, config: DefaultPrefetchConfig | None = None) -> None:
        self.config = config or DefaultPrefetchConfig()

    def select_load_plan(
        self,
        keys: Sequence[ObjectKey],
        found: Sequence[Sequence[bool]],
        adapters: Sequence[AdapterInfo],
    ) -> dict[int, list[bool]]:
        return plan_from_lowest_index(keys, found, adapters)
