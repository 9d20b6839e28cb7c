"""The ``noop`` eviction policy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from lmcache_plugin_eviction_noop import NoopEvictionConfig
from lmcache_tiers.plugin import ObjectKey


class NoopEvictionPolicy:
    """Offers no victims, so it needs no bookkeeping at all."""

    def __init__(self, config: NoopEvictionConfig | None = None) -> None:
        self.config = config or NoopEvictionConfig()

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def victims(self) -> Iterator[ObjectKey]:
        return iter(())
