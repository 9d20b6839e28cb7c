"""The public API of lmcache-tiers for plugin authors.

A plugin imports from here and nowhere else in ``lmcache_tiers``: these names are what the
project keeps stable for third-party packages.  Conformance suites live in
:mod:`lmcache_tiers.testing` (they import pytest, so they are not pulled in here).
"""

from lmcache_tiers.config import ComponentConfig, L2AdapterConfig, L2EvictionConfig
from lmcache_tiers.errors import BackendUnavailableError, ConfigError, TiersError
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keycodec import is_digest_name, key_to_name, name_to_key, printable
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.layout import TensorLayout
from lmcache_tiers.policies import (
    AdapterInfo,
    EvictionPolicy,
    LowestIndexPrefetchPolicy,
    PrefetchPolicy,
    StorePolicy,
    plan_from_lowest_index,
)
from lmcache_tiers.registry import EmptyConfig, KindRegistry
from lmcache_tiers.serde import Serde, SerdeContext

__all__ = [
    "AdapterInfo",
    "BackendUnavailableError",
    "ComponentConfig",
    "ConfigError",
    "EmptyConfig",
    "EvictionPolicy",
    "KindRegistry",
    "L2AdapterConfig",
    "L2EvictionConfig",
    "LowestIndexPrefetchPolicy",
    "ObjectKey",
    "PrefetchPolicy",
    "Serde",
    "SerdeContext",
    "StorePolicy",
    "TensorLayout",
    "TiersError",
    "hookimpl",
    "is_digest_name",
    "key_to_name",
    "name_to_key",
    "plan_from_lowest_index",
    "printable",
]
