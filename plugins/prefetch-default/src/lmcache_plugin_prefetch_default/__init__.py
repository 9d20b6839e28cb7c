"""Prefetch policy ``default``: nearest adapter wins, loaded objects are temporary."""

from __future__ import annotations

import msgspec

from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.registry import KindRegistry


class DefaultPrefetchConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Load each hit from the lowest-index adapter holding it; free it from L1 after its last read."""


@hookimpl
def tiers_register_prefetch_policies(registry: KindRegistry) -> None:
    registry.add(
        "default", "lmcache_plugin_prefetch_default.policy:DefaultPrefetchPolicy", DefaultPrefetchConfig
    )
