"""Eviction policy ``ARC``: adaptive replacement cache (recency and frequency lists)."""

from __future__ import annotations

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class ARCConfig(ComponentConfig):
    """Adaptive Replacement Cache: keys seen once and keys seen again live in two LRU lists,
    and ghost lists of recently evicted keys move the split between them towards whichever
    list would have kept the key; within one batch the tail of the prefix goes first."""


@hookimpl
def tiers_register_eviction_policies(registry: KindRegistry) -> None:
    registry.add("ARC", "lmcache_plugin_eviction_arc.policy:ARCEvictionPolicy", ARCConfig)
