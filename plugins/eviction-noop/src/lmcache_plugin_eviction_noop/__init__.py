"""Eviction policy ``noop``: never evicts anything."""

from __future__ import annotations

import msgspec

from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.registry import KindRegistry


class NoopEvictionConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Never evict.  Objects leave only when deleted (e.g. by the ``skip_l1`` store policy);
    when memory is full, new writes are refused instead."""


@hookimpl
def tiers_register_eviction_policies(registry: KindRegistry) -> None:
    registry.add("noop", "lmcache_plugin_eviction_noop.policy:NoopEvictionPolicy", NoopEvictionConfig)
