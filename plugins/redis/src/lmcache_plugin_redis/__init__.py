"""lmcache-tiers plugin: the L2 adapter ``redis`` (Redis and Valkey, standalone or cluster).

A light manifest: the adapter is registered by ``"module:attr"`` so that listing plugins
never imports redis-py.  LMCache's type names for the same store, ``resp`` and
``valkey``, are registered as aliases: their JSON fields (``host``/``port``,
``startup_nodes``, ``cluster_mode``, ``username``, ``password``, ``key_prefix``,
``num_workers``, ``tls_enable``, ``database_id``, ``request_timeout``,
``connection_timeout``, ``max_capacity_gb``) mean the same here.
"""

from __future__ import annotations

from lmcache_plugin_redis.config import LMCACHE_ALIASES, RedisConfig
from lmcache_tiers.plugin import KindRegistry, hookimpl

__all__ = ["RedisConfig", "tiers_register_l2_adapters"]

_FACTORY = "lmcache_plugin_redis.backend:RedisBackend"
_INSTALL_HINT = "pip install lmcache-plugin-redis (it brings redis-py and hiredis)"


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("redis", _FACTORY, RedisConfig, install_hint=_INSTALL_HINT)
    for alias in LMCACHE_ALIASES:
        registry.add(
            alias,
            _FACTORY,
            RedisConfig,
            f"Alias of redis: LMCache's `{alias}` type name; its JSON fields mean the same here.",
            install_hint=_INSTALL_HINT,
        )
