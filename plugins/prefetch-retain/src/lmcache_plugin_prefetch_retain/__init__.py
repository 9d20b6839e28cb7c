"""Prefetch policy ``retain``: nearest adapter wins, loaded objects stay in L1."""

from __future__ import annotations

import msgspec

from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.registry import KindRegistry


class RetainPrefetchConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Load each hit from the lowest-index adapter holding it; keep it in L1 for later hits."""


@hookimpl
def tiers_register_prefetch_policies(registry: KindRegistry) -> None:
    registry.add("retain", "lmcache_plugin_prefetch_retain.policy:RetainPrefetchPolicy", RetainPrefetchConfig)
