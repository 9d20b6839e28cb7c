"""Prefetch policy ``default``: nearest adapter wins, loaded objects are temporary."""

from __future__ import annotations

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class DefaultPrefetchConfig(ComponentConfig):
    """Load each hit from the lowest-index adapter holding it; free it from L1 after its last read."""


@hookimpl
def tiers_register_prefetch_policies(registry: KindRegistry) -> None:
    registry.add(
        "default", "lmcache_plugin_prefetch_default.policy:DefaultPrefetchPolicy", DefaultPrefetchConfig
    )
