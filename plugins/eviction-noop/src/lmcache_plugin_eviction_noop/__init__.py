"""Eviction policy ``noop``: never evicts anything."""

from __future__ import annotations

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class NoopEvictionConfig(ComponentConfig):
    """Never evict.  Objects leave only when deleted (e.g. by the ``skip_l1`` store policy);
    when memory is full, new writes are refused instead."""


@hookimpl
def tiers_register_eviction_policies(registry: KindRegistry) -> None:
    registry.add("noop", "lmcache_plugin_eviction_noop.policy:NoopEvictionPolicy", NoopEvictionConfig)
