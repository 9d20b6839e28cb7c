"""Store policy ``skip_l1``: L1 is only a staging buffer in front of L2."""

from __future__ import annotations

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class SkipL1StoreConfig(ComponentConfig):
    """Store every written object in every L2 adapter, then drop it from L1.

    With eviction policy ``noop`` this is the buffer-only mode: L1 holds an object only
    until L2 has it (and while a prefetch has it loaded).
    """


@hookimpl
def tiers_register_store_policies(registry: KindRegistry) -> None:
    registry.add("skip_l1", "lmcache_plugin_store_skip_l1.policy:SkipL1StorePolicy", SkipL1StoreConfig)
