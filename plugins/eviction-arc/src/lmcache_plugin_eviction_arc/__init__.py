"""Eviction policy ``ARC``: adaptive replacement cache (recency and frequency lists)."""

from __future__ import annotations

import msgspec

from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.registry import KindRegistry


class ARCConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Adaptive Replacement Cache: keys seen once and keys seen again live in two LRU lists,
    and ghost lists of recently evicted keys move the split between them towards whichever
    list would have kept the key; within one batch the tail of the prefix goes first."""


@hookimpl
def tiers_register_eviction_policies(registry: KindRegistry) -> None:
    registry.add("ARC", "lmcache_plugin_eviction_arc.policy:ARCEvictionPolicy", ARCConfig)
