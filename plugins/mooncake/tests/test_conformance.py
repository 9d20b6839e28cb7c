"""``mooncake_store`` against the L2 conformance suite, on a real master and segment host.

Objects live in the segment host's memory (the adapter lends none), so they outlive the
adapter that stored them: reopening finds them, and the master's key listing seeds the
accounting.  A second run has a serde chain, so that lookups of keys the adapter does not know
(after reopening) read the L1 size from the record header.
"""

from __future__ import annotations

import pytest
from lmcache_plugin_mooncake import MooncakeStoreConfig
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import Xor, config_for

from lmcache_tiers.l2 import AdapterContext
from lmcache_tiers.plugin import CAPACITY, EVICTION, PERSISTENCE, L2AdapterConfig, L2AdapterSuite


class TestMooncakeStore(L2AdapterSuite):
    component_name = "mooncake_store"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_pool: LocalCluster) -> None:
        self.cluster = mooncake_pool

    def make_config(self) -> MooncakeStoreConfig:
        # 256 KiB: the capacity tests fill it with 16 objects of 16 KiB
        return config_for(self.cluster, max_capacity_gb=1 / 4096)


class TestMooncakeStoreWithSerde(TestMooncakeStore):
    def make_context(self, config: L2AdapterConfig, l1_buffer: memoryview) -> AdapterContext:
        return AdapterContext(
            index=0, name="0:mooncake_store", config=config, serde=(Xor(),), l1_buffer=l1_buffer
        )
