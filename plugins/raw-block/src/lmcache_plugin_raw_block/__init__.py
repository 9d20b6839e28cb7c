"""lmcache-tiers plugin: the L2 adapter type ``raw_block``.

A light manifest: the config Struct and the hook registering the backend by
``"module:attr"``, so listing plugins does no I/O; the implementation loads when a
``raw_block`` adapter is configured.  The slot bookkeeping, slot headers, superblocks and
device guards are also what ``lmcache-plugin-dax`` builds on.
"""

from __future__ import annotations

from lmcache_plugin_raw_block.config import RawBlockConfig
from lmcache_tiers.plugin import KindRegistry, hookimpl

__all__ = ["RawBlockConfig", "tiers_register_l2_adapters"]


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("raw_block", "lmcache_plugin_raw_block.backend:RawBlockBackend", RawBlockConfig)
