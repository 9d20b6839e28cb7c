"""Both NIXL adapter types against the L2 adapter conformance suite, on real NIXL POSIX."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest
from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig
from nixl_helpers import dynamic_config, pool_config

from lmcache_tiers.testing.l2 import CAPACITY, EVICTION, PERSISTENCE, L2AdapterSuite


class _ScratchDirectory:
    storage_dir: str

    @pytest.fixture(autouse=True)
    def _storage_dir(self) -> Iterator[None]:
        # Autouse fixtures run before the suite's adapter fixture, which calls make_config.
        self.storage_dir = tempfile.mkdtemp(prefix="lmcache-nixl-suite-")
        yield
        shutil.rmtree(self.storage_dir, ignore_errors=True)


class TestNixlStoreConformance(_ScratchDirectory, L2AdapterSuite):
    component_name = "nixl_store"
    # The pool is the capacity (usage = slots in use); deletes return slots. Nothing
    # survives a restart, so no PERSISTENCE.
    capabilities = frozenset({CAPACITY, EVICTION})

    def make_config(self) -> NixlStoreConfig:
        # 64 slots: room for the suite's largest batch (32 keys) and small enough that the
        # capacity tests fill it well before their 512-object limit.
        return pool_config(self.storage_dir, pool_size=64)


class TestNixlStoreDynamicConformance(_ScratchDirectory, L2AdapterSuite):
    component_name = "nixl_store_dynamic"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    def make_config(self) -> NixlStoreDynamicConfig:
        # 2 MiB: 128 objects of the suite's 16 KiB before stores are refused.
        return dynamic_config(self.storage_dir, capacity_gb=2 / 1024)


class TestNixlStoreDynamicShardedConformance(TestNixlStoreDynamicConformance):
    def make_config(self) -> NixlStoreDynamicConfig:
        return dynamic_config(self.storage_dir, capacity_gb=2 / 1024, shard_dirs=True)
