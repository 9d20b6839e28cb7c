"""lmcache-tiers plugin: the L2 adapter ``redis`` (Redis and Valkey, standalone or cluster).

A light manifest: the adapter is registered by ``"module:attr"`` so that listing plugins
never imports redis-py.  LMCache's type names for the same store, ``resp`` and
``valkey``, are registered with ``LMCacheRedisConfig``: their JSON fields (``host``/``port``,
``startup_nodes``, ``cluster_mode``, ``username``, ``password``, ``key_prefix``,
``num_workers``, ``tls_enable``, ``database_id``, ``request_timeout``,
``connection_timeout``, ``max_capacity_gb``) mean the same here, LMCache's defaults
included (``key_prefix`` "" joined by "@", ``num_workers`` 8).
"""

from __future__ import annotations

from lmcache_plugin_redis.config import LMCACHE_ALIASES, LMCacheRedisConfig, RedisConfig
from lmcache_tiers.plugin import KindRegistry, hookimpl

__all__ = ["LMCacheRedisConfig", "RedisConfig", "tiers_register_l2_adapters"]

_FACTORY = "lmcache_plugin_redis.backend:RedisBackend"
_INSTALL_HINT = "pip install lmcache-plugin-redis (it brings redis-py and hiredis)"


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("redis", _FACTORY, RedisConfig, install_hint=_INSTALL_HINT)
    for alias in LMCACHE_ALIASES:
        registry.add(
            alias,
            _FACTORY,
            LMCacheRedisConfig,
            f"The redis adapter under LMCache's `{alias}` type name: its JSON fields and defaults "
            'mean what they do in LMCache (key_prefix "" and joined by "@", num_workers 8).',
            install_hint=_INSTALL_HINT,
        )
