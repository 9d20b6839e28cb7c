"""Store policy ``default``: every key goes to every adapter and L1 keeps its copy."""

from __future__ import annotations

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class DefaultStoreConfig(ComponentConfig):
    """Store every written object in every L2 adapter, and keep its L1 copy once stored
    (only L1 eviction frees it, as it frees any object)."""


@hookimpl
def tiers_register_store_policies(registry: KindRegistry) -> None:
    registry.add("default", "lmcache_plugin_store_default.policy:DefaultStorePolicy", DefaultStoreConfig)
