"""lmcache-tiers plugin: NIXL L2 adapters ``nixl_store`` and ``nixl_store_dynamic``.

A light manifest: it registers the two adapter types by ``"module:attr"`` so listing
plugins never imports NIXL; the implementation loads when an adapter is configured.
Both types share one NIXL agent per process (``runtime.NixlRuntime``).
"""

from __future__ import annotations

from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig
from lmcache_tiers.plugin import KindRegistry, hookimpl

__all__ = ["NixlStoreConfig", "NixlStoreDynamicConfig", "tiers_register_l2_adapters"]

_INSTALL_HINT = "pip install lmcache-plugin-nixl nixl"


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add(
        "nixl_store",
        "lmcache_plugin_nixl.store:NixlStoreBackend",
        NixlStoreConfig,
        install_hint=_INSTALL_HINT,
    )
    registry.add(
        "nixl_store_dynamic",
        "lmcache_plugin_nixl.dynamic:NixlDynamicBackend",
        NixlStoreDynamicConfig,
        install_hint=_INSTALL_HINT,
    )
