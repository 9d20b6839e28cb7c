"""Store policy ``skip_l1``: L1 is only a staging buffer in front of L2."""

from __future__ import annotations

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class SkipL1StoreConfig(ComponentConfig):
    """Store every written object in every L2 adapter, then drop it from L1.

    An object leaves L1 once all its stores are done and at least one adapter holds it
    (one being read leaves after its last reader). One no adapter stored is counted once
    (``l2_store_failed``) and stays in L1 as an ordinary object: L1 eviction may take it
    like any other, uncounted again.

    With eviction policy ``noop`` and prefetch policy ``default`` this is the buffer-only
    mode: L1 holds an object only until L2 has it, and while a prefetch has it loaded.
    Prefetch policy ``retain`` does not fit that mode: nothing deletes the objects it
    loads, so L1 fills up with them and refuses writes.
    """


@hookimpl
def tiers_register_store_policies(registry: KindRegistry) -> None:
    registry.add("skip_l1", "lmcache_plugin_store_skip_l1.policy:SkipL1StorePolicy", SkipL1StoreConfig)
