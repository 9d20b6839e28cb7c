"""lmcache-tiers plugin: the L2 adapter type ``dax``.

A light manifest: the config Struct and the hook registering the backend by
``"module:attr"``, so listing plugins maps nothing; the implementation loads when a
``dax`` adapter is configured.
"""

from __future__ import annotations

from lmcache_plugin_dax.config import DaxConfig, DaxDevice
from lmcache_tiers.plugin import KindRegistry, hookimpl

__all__ = ["DaxConfig", "DaxDevice", "tiers_register_l2_adapters"]


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("dax", "lmcache_plugin_dax.backend:DaxBackend", DaxConfig)
