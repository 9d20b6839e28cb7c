"""Both NIXL adapter types against the L2 adapter conformance suite, on real NIXL POSIX;
the failure test makes nixl_store_dynamic's directory fail for real."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig
from nixl_helpers import dynamic_config, pool_config

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.files import ScratchDirectory, directory_replaced_by_file
from lmcache_tiers.testing.l2 import (
    BACKEND_FAILURES,
    CAPACITY,
    EVICTION,
    IMMEDIATE_HITS,
    IMMEDIATE_MISSES,
    PERSISTENCE,
    L2AdapterSuite,
)


class TestNixlStoreConformance(ScratchDirectory, L2AdapterSuite):
    component_name = "nixl_store"
    # The pool is the capacity (usage = slots in use); deletes return slots. Nothing
    # survives a restart, so no PERSISTENCE.
    capabilities = frozenset({CAPACITY, EVICTION, IMMEDIATE_MISSES, IMMEDIATE_HITS})

    def make_config(self) -> NixlStoreConfig:
        # 64 slots: room for the suite's largest batch (32 keys) and small enough that the
        # capacity tests fill it well before their 512-object limit.
        return pool_config(self.storage_dir, pool_size=64)


class TestNixlStoreDynamicConformance(ScratchDirectory, L2AdapterSuite):
    component_name = "nixl_store_dynamic"
    # misses are told from memory; a hit is confirmed by its record file
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, IMMEDIATE_MISSES, BACKEND_FAILURES})

    def make_config(self) -> NixlStoreDynamicConfig:
        # 2 MiB: 128 objects of the suite's 16 KiB before stores are refused.
        return dynamic_config(self.storage_dir, capacity_gb=2 / 1024)

    @contextmanager
    def failing_storage(self, adapter: L2Adapter) -> Iterator[None]:
        # A regular file stands at the directory's path: ENOTDIR below it, not ENOENT.
        with directory_replaced_by_file(self.storage_dir):
            yield


class TestNixlStoreDynamicShardedConformance(TestNixlStoreDynamicConformance):
    def make_config(self) -> NixlStoreDynamicConfig:
        return dynamic_config(self.storage_dir, capacity_gb=2 / 1024, shard_dirs=True)
