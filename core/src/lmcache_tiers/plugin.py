"""The public API of lmcache-tiers for plugin authors.

A plugin imports from here and nowhere else in ``lmcache_tiers``: these names are what the
project keeps stable for third-party packages.  Conformance suites live in
:mod:`lmcache_tiers.testing` (they import pytest, so they are not pulled in here).
"""

from lmcache_tiers.config import (
    ComponentConfig,
    FrontendConfig,
    L2AdapterConfig,
    L2EvictionConfig,
    ServerConfig,
)
from lmcache_tiers.endpoints import is_loopback
from lmcache_tiers.errors import (
    BackendUnavailableError,
    ConfigError,
    KeyValidationError,
    L1OutOfMemoryError,
    TiersError,
)
from lmcache_tiers.frontend import Frontend, FrontendContext, FrontendStats
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keycodec import is_digest_name, key_to_name, name_to_key, printable
from lmcache_tiers.keys import NONE_HASH, ObjectKey, chunk_hashes, kv_rank_of
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
    "NONE_HASH",
    "AdapterInfo",
    "BackendUnavailableError",
    "ComponentConfig",
    "ConfigError",
    "EmptyConfig",
    "EvictionPolicy",
    "Frontend",
    "FrontendConfig",
    "FrontendContext",
    "FrontendStats",
    "KeyValidationError",
    "KindRegistry",
    "L1OutOfMemoryError",
    "L2AdapterConfig",
    "L2EvictionConfig",
    "LowestIndexPrefetchPolicy",
    "ObjectKey",
    "PrefetchPolicy",
    "Serde",
    "SerdeContext",
    "ServerConfig",
    "StorePolicy",
    "TensorLayout",
    "TiersError",
    "chunk_hashes",
    "hookimpl",
    "is_digest_name",
    "is_loopback",
    "key_to_name",
    "kv_rank_of",
    "name_to_key",
    "plan_from_lowest_index",
    "printable",
]
