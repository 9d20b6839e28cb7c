"""The ``skip_l1`` store policy."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_plugin_store_skip_l1 import SkipL1StoreConfig
from lmcache_tiers.plugin import AdapterInfo, ObjectKey


class SkipL1StorePolicy:
    """All keys to all adapters; every successfully stored key leaves L1."""

    def __init__(self, config: SkipL1StoreConfig | None = None) -> None:
        self.config = config or SkipL1StoreConfig()

    def select_store_targets(
        self, keys: Sequence[ObjectKey], adapters: Sequence[AdapterInfo]
    ) -> dict[int, list[ObjectKey]]:
        return {adapter.index: list(keys) for adapter in adapters} if keys else {}

    def select_l1_deletions(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        return list(keys)
