"""Eviction policy ``LRU``: least recently used first."""

from __future__ import annotations

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class LRUConfig(ComponentConfig):
    """Evict the least recently written or read object first; within one batch the tail of
    the prefix goes before its head, so what remains is still a usable prefix."""


@hookimpl
def tiers_register_eviction_policies(registry: KindRegistry) -> None:
    registry.add("LRU", "lmcache_plugin_eviction_lru.policy:LRUEvictionPolicy", LRUConfig)
