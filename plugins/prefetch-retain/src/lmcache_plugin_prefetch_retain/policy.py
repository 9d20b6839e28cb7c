"""The ``retain`` prefetch policy."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_plugin_prefetch_retain import RetainPrefetchConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.policies import AdapterInfo, plan_from_lowest_index


class RetainPrefetchPolicy:
    """Same plan as ``default``, but loaded objects become ordinary L1 objects.

    They stay after the reader releases them and are subject to L1 eviction like any
    written object, so a repeated prefix hits L1 without another L2 load.
    """

    retain_loaded = True

    def __init__(self, config: RetainPrefetchConfig | None = None) -> None:
        self.config = config or RetainPrefetchConfig()

    def select_load_plan(
        self,
        keys: Sequence[ObjectKey],
        found: Sequence[Sequence[bool]],
        adapters: Sequence[AdapterInfo],
    ) -> dict[int, list[bool]]:
        return plan_from_lowest_index(keys, found, adapters)
