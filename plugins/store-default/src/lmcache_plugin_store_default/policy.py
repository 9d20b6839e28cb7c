"""The ``default`` store policy."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_plugin_store_default import DefaultStoreConfig
from lmcache_tiers.plugin import AdapterInfo, ObjectKey


class DefaultStorePolicy:
    """All keys to all adapters; L1 keeps every object (eviction frees it later)."""

    def __init__(self, config: DefaultStoreConfig | None = None) -> None:
        self.config = config or DefaultStoreConfig()

    def select_store_targets(
        self, keys: Sequence[ObjectKey], adapters: Sequence[AdapterInfo]
    ) -> dict[int, list[ObjectKey]]:
        return {adapter.index: list(keys) for adapter in adapters} if keys else {}

    def select_l1_deletions(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        return []
