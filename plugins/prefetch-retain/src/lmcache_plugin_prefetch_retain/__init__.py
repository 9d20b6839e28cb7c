"""Prefetch policy ``retain``: nearest adapter wins, loaded objects stay in L1."""

from __future__ import annotations

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class RetainPrefetchConfig(ComponentConfig):
    """Load each hit from the lowest-index adapter holding it; keep it in L1 for later hits.

    A loaded object stays after its last reader is done and leaves only when L1 eviction
    takes it, like any written object: with eviction policy ``noop`` it never does, and
    loaded objects fill L1 until writes are refused (``l1_write_oom``).
    """


@hookimpl
def tiers_register_prefetch_policies(registry: KindRegistry) -> None:
    registry.add("retain", "lmcache_plugin_prefetch_retain.policy:RetainPrefetchPolicy", RetainPrefetchConfig)
