"""L2 adapter ``mooncake_store``: a Mooncake Store pool shared by lmcache-tiers servers."""

from __future__ import annotations

from lmcache_plugin_mooncake.config import MooncakeStoreConfig
from lmcache_tiers.plugin import KindRegistry, hookimpl

__all__ = ["MooncakeStoreConfig"]


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add(
        "mooncake_store", "lmcache_plugin_mooncake.backend:MooncakeStoreBackend", MooncakeStoreConfig
    )
